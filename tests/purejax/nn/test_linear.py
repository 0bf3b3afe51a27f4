"""purejax.nn.linear against float64 numpy, its initialisation against jax.nn.initializers, and its errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import initializers, linear


def test_init_shapes_dtypes_and_default_initializer():
    key = jax.random.key(0)
    params = linear.init(key, 3, 5)
    chex.assert_shape(params["w"], (3, 5))
    chex.assert_trees_all_equal(params["b"], jnp.zeros(5))
    # default: LeCun normal over (d_in, d_out), the same draw as jax's own initializer with the same key
    chex.assert_trees_all_close(params["w"], jax.nn.initializers.lecun_normal()(key, (3, 5)), rtol=1e-6)
    assert set(linear.init(key, 3, 5, bias=False)) == {"w"}
    bf16 = linear.init(key, 3, 5, dtype=jnp.bfloat16)
    assert bf16["w"].dtype == bf16["b"].dtype == jnp.bfloat16


def test_init_with_a_custom_initializer():
    params = linear.init(jax.random.key(0), 4, 2, w_init=initializers.zeros())
    chex.assert_trees_all_equal(params, {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)})


@pytest.mark.parametrize("batch", [(), (7,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64_numpy(batch, bias):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
    if bias:
        params["b"] = jnp.asarray(rng.normal(size=4), jnp.float32)
    x = rng.normal(size=(*batch, 6)).astype(np.float32)
    y = linear.apply(params, jnp.asarray(x))
    want = x.astype(np.float64) @ np.asarray(params["w"], np.float64)
    if bias:
        want = want + np.asarray(params["b"], np.float64)
    chex.assert_shape(y, (*batch, 4))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


class LinearVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_same_result_with_and_without_jit(self):
        params = linear.init(jax.random.key(1), 3, 5)
        x = np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32)
        y = self.variant(linear.apply)(params, jnp.asarray(x))
        chex.assert_shape(y, (4, 5))
        want = np.asarray(x, np.float64) @ np.asarray(params["w"], np.float64) + np.asarray(params["b"], np.float64)
        chex.assert_trees_all_close(y, want.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_gradients_are_the_matmul_transposes():
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32), "b": jnp.zeros(2)}
    x = rng.normal(size=(4, 5)).astype(np.float32)
    dy = rng.normal(size=(4, 2)).astype(np.float32)
    g_params, g_x = jax.grad(lambda p, x: jnp.sum(linear.apply(p, x) * dy), argnums=(0, 1))(params, jnp.asarray(x))
    np.testing.assert_allclose(g_params["w"], x.T.astype(np.float64) @ dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_params["b"], dy.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, dy.astype(np.float64) @ np.asarray(params["w"]).T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors


def test_wrong_input_feature_size_names_the_argument_and_both_shapes():
    params = linear.init(jax.random.key(0), 3, 5)
    with pytest.raises(ValueError) as err:
        linear.apply(params, jnp.ones((2, 4)))
    assert (
        str(err.value) == "linear: x has shape (2, 4), but its axis -1 must be 3 to match params['w'] of shape (3, 5)"
    )


def test_int_input_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError) as err:
        linear.apply(linear.init(jax.random.key(0), 3, 5), jnp.ones((2, 3), jnp.int32))
    msg = str(err.value)
    assert "purejax.nn.linear.apply" in msg and "parameter 'x'" in msg and "i32[2,3]" in msg and "'*batch d_in'" in msg


def test_scalar_input_fails_at_the_call():
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        linear.apply(linear.init(jax.random.key(0), 3, 5), jnp.float32(1.0))


def test_missing_and_extra_param_keys():
    params = linear.init(jax.random.key(0), 3, 5)
    with pytest.raises(KeyError, match=r"linear: params have missing keys \['w'\] and unexpected keys \['kernel'\]"):
        linear.apply({"kernel": params["w"], "b": params["b"]}, jnp.ones((2, 3)))
    with pytest.raises(KeyError, match=r"unexpected keys \['scale'\]; expected \['w'\] and optionally \['b'\]"):
        linear.apply({**params, "scale": jnp.ones(5)}, jnp.ones((2, 3)))


@pytest.mark.parametrize("d_in, d_out", [(0, 4), (4, 0), (-1, 4)])
def test_impossible_sizes(d_in, d_out):
    with pytest.raises(
        ValueError, match=f"linear.init: d_in and d_out must be positive, got d_in={d_in}, d_out={d_out}"
    ):
        linear.init(jax.random.key(0), d_in, d_out)


def test_numpy_input_is_accepted_and_a_wrong_numpy_shape_is_named():
    params = linear.init(jax.random.key(0), 3, 5)
    x = np.ones((4, 3), np.float32)
    np.testing.assert_allclose(linear.apply(params, x), linear.apply(params, jnp.asarray(x)))
    with pytest.raises(ValueError, match=r"linear: x has shape \(4, 2\), but its axis -1 must be 3"):
        linear.apply(params, np.ones((4, 2), np.float32))
