"""purejax.nn.embedding: lookup and the tied un-embedding (attend) against numpy, out-of-range ids, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import embedding, initializers


def table(vocab=11, d=4, seed=0):
    return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(vocab, d)), jnp.float32)}


def test_init():
    key = jax.random.key(0)
    params = embedding.init(key, 11, 4)
    chex.assert_shape(params["w"], (11, 4))
    # default N(0, 1), by initializers.normal's definition (stddev * jax.random.normal), with the table's shape
    np.testing.assert_array_equal(params["w"], jax.random.normal(key, (11, 4), jnp.float32))
    gpt2 = embedding.init(key, 11, 4, w_init=initializers.normal(0.02), dtype=jnp.bfloat16)
    assert gpt2["w"].dtype == jnp.bfloat16
    # not compared with jax.nn.initializers.normal: from jax 0.12 that draws bfloat16 normals by another
    # formula (erf_inv), a few bfloat16 ulps away; the distribution itself is tested in test_initializers.py
    np.testing.assert_array_equal(gpt2["w"], 0.02 * jax.random.normal(key, (11, 4), jnp.bfloat16))


@pytest.mark.parametrize("shape", [(), (5,), (2, 3)])
def test_lookup_matches_numpy_indexing(shape):
    params = table()
    ids = np.random.default_rng(1).integers(0, 11, size=shape)
    out = embedding.apply(params, jnp.asarray(ids, jnp.int32))
    chex.assert_shape(out, (*shape, 4))
    np.testing.assert_array_equal(out, np.asarray(params["w"])[ids])


def test_lookup_accepts_any_integer_dtype():
    params = table()
    for dtype in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint32):
        np.testing.assert_array_equal(
            embedding.apply(params, jnp.array([10, 0], dtype)), params["w"][jnp.array([10, 0])]
        )


@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_ids_give_nan_rows_never_a_clamped_or_wrapped_row(jit):
    params = table()
    apply = jax.jit(embedding.apply) if jit else embedding.apply
    out = np.asarray(apply(params, jnp.array([3, 11, -1, 1000, -11, 0])))
    np.testing.assert_array_equal(out[[0, 5]], np.asarray(params["w"])[[3, 0]])
    assert np.isnan(out[[1, 2, 3, 4]]).all()


def test_lookup_gradient_scatters_into_the_rows_used():
    params = table(vocab=5, d=3)
    ids = jnp.array([[1, 3], [1, 4]])
    dy = np.random.default_rng(2).normal(size=(2, 2, 3)).astype(np.float32)
    grad = jax.grad(lambda p: jnp.sum(embedding.apply(p, ids) * dy))(params)["w"]
    want = np.zeros((5, 3))
    np.add.at(want, np.asarray(ids).ravel(), dy.reshape(-1, 3))
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)


def test_attend_is_the_tied_lm_head():
    params = table()
    h = np.random.default_rng(3).normal(size=(2, 3, 4)).astype(np.float32)
    logits = embedding.attend(params, jnp.asarray(h))
    chex.assert_shape(logits, (2, 3, 11))
    np.testing.assert_allclose(
        logits, h.astype(np.float64) @ np.asarray(params["w"], np.float64).T, rtol=1e-5, atol=1e-5
    )


class EmbeddingVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_lookup_then_attend(self):
        params = table()
        ids = jnp.array([[0, 5, 10]])

        def logits(params, ids):
            return embedding.attend(params, embedding.apply(params, ids))

        out = self.variant(logits)(params, ids)
        w = np.asarray(params["w"], np.float64)
        chex.assert_trees_all_close(out, (w[np.asarray(ids)] @ w.T).astype(np.float32), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors


def test_float_ids_fail_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError) as err:
        embedding.apply(table(), jnp.array([1.0, 2.0]))
    msg = str(err.value)
    assert "parameter 'ids'" in msg and "f32[2]" in msg and "Integer[" in msg


def test_attend_wrong_width_names_the_argument_and_both_shapes():
    with pytest.raises(ValueError) as err:
        embedding.attend(table(), jnp.ones((2, 5)))
    want = "embedding.attend: x has shape (2, 5), but its axis -1 must be 4 to match params['w'] of shape (11, 4)"
    assert str(err.value) == want


def test_missing_and_extra_param_keys():
    with pytest.raises(
        KeyError, match=r"embedding: params have missing keys \['w'\] and unexpected keys \['embedding'\]"
    ):
        embedding.apply({"embedding": jnp.ones((3, 2))}, jnp.array([0]))
    with pytest.raises(KeyError, match=r"unexpected keys \['b'\]"):
        embedding.attend({"w": jnp.ones((3, 2)), "b": jnp.zeros(3)}, jnp.ones((1, 2)))


@pytest.mark.parametrize("vocab, d", [(0, 4), (4, 0)])
def test_impossible_sizes(vocab, d):
    with pytest.raises(ValueError, match="embedding.init: vocab_size and d_model must be positive"):
        embedding.init(jax.random.key(0), vocab, d)


def test_numpy_and_python_ids_are_accepted():
    params = table()
    np.testing.assert_array_equal(embedding.apply(params, np.array([[2, 7]])), params["w"][jnp.array([[2, 7]])])
    np.testing.assert_array_equal(embedding.apply(params, 7), params["w"][7])
