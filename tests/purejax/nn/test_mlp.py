"""purejax.nn.mlp against float64 numpy, its named-key initialisation, dropout, the no-retrace guarantee under
jit, and errors that name the path."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax import random as prandom
from purejax.nn import activations, dropout, initializers, linear, mlp

KEY = jax.random.key(0)
# One set of sizes throughout: each new weight shape costs a compile of the random-number kernel in `init`.
PARAMS = mlp.init(KEY, 6, 12)


def reference(params, x, activation=np.vectorize(lambda v: v * 0.5 * (1 + math.erf(v / math.sqrt(2))))):
    """float64 numpy: proj(gelu(fc(x))), exact GELU via math.erf."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    h = activation(np.asarray(x, np.float64) @ p["fc"]["w"] + p["fc"]["b"])
    return h @ p["proj"]["w"] + p["proj"]["b"]


def test_init_structure_and_shapes():
    want = {"fc": {"w": (6, 12), "b": (12,)}, "proj": {"w": (12, 6), "b": (6,)}}
    assert jax.tree_util.tree_map(jnp.shape, PARAMS) == want
    # eval_shape: the structure without drawing (or compiling) anything
    shapes = jax.eval_shape(lambda k: mlp.init(k, 4, 16, 3, bias=False, dtype=jnp.bfloat16), KEY)
    assert jax.tree_util.tree_map(jnp.shape, shapes) == {"fc": {"w": (4, 16)}, "proj": {"w": (16, 3)}}
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(shapes))


def test_init_uses_named_keys():
    keys = prandom.named_keys(KEY, "fc", "proj")
    chex.assert_trees_all_equal(PARAMS["fc"], linear.init(keys["fc"], 6, 12))
    chex.assert_trees_all_equal(PARAMS["proj"], linear.init(keys["proj"], 12, 6))


def test_proj_init_overrides_only_the_down_projection():
    params = mlp.init(KEY, 6, 12, proj_init=initializers.zeros())
    chex.assert_trees_all_equal(params["proj"]["w"], jnp.zeros((12, 6)))
    chex.assert_trees_all_equal(params["fc"], PARAMS["fc"])
    np.testing.assert_array_equal(mlp.apply(params, jnp.ones((2, 6))), np.zeros((2, 6)))  # starts as zero (residual)


@pytest.mark.parametrize("batch", [(), (3,), (2, 5)])
def test_matches_float64_numpy(batch):
    x = np.random.default_rng(0).normal(size=(*batch, 6)).astype(np.float32)
    y = mlp.apply(PARAMS, jnp.asarray(x))
    chex.assert_shape(y, (*batch, 6))
    np.testing.assert_allclose(y, reference(PARAMS, x), rtol=1e-5, atol=1e-5)


def test_d_out_differs_from_d_in():
    params = {"fc": PARAMS["fc"], "proj": linear.init(KEY, 12, 5)}
    assert jax.tree_util.tree_map(jnp.shape, mlp.init(KEY, 6, 12, 5)) == jax.tree_util.tree_map(jnp.shape, params)
    x = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    np.testing.assert_allclose(mlp.apply(params, jnp.asarray(x)), reference(params, x), rtol=1e-5, atol=1e-5)


def test_other_activations():
    x = np.random.default_rng(1).normal(size=(3, 6)).astype(np.float32)
    y = mlp.apply(PARAMS, jnp.asarray(x), activation=activations.relu)
    np.testing.assert_allclose(y, reference(PARAMS, x, activation=lambda h: np.maximum(h, 0)), rtol=1e-5, atol=1e-5)


def test_dropout_applies_only_with_a_key():
    params = PARAMS
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6)), jnp.float32)
    clean = mlp.apply(params, x, dropout=0.5)
    chex.assert_trees_all_close(clean, mlp.apply(params, x), rtol=1e-6)
    dropped = mlp.apply(params, x, dropout=0.5, key=jax.random.key(2))
    chex.assert_trees_all_close(dropped, dropout.apply(clean, rate=0.5, key=jax.random.key(2)), rtol=1e-6)


class MlpVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_same_result_with_and_without_jit(self):
        params = PARAMS
        x = np.random.default_rng(2).normal(size=(4, 6)).astype(np.float32)
        y = self.variant(lambda p, x: mlp.apply(p, x, activation=activations.gelu_tanh))(params, jnp.asarray(x))
        chex.assert_shape(y, (4, 6))
        c = math.sqrt(2 / math.pi)
        want = reference(params, x, activation=lambda h: 0.5 * h * (1 + np.tanh(c * (h + 0.044715 * h**3))))
        chex.assert_trees_all_close(y, want.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_jitted_apply_traces_once_for_same_shaped_inputs():
    params = PARAMS

    @jax.jit
    @chex.assert_max_traces(n=1)
    def forward(params, x):
        return mlp.apply(params, x)

    for i in range(5):  # new values, new params, same shapes and dtypes: no retrace
        x = jnp.asarray(np.random.default_rng(i).normal(size=(4, 6)), jnp.float32)
        forward(jax.tree_util.tree_map(lambda p, shift=i: p + shift, params), x).block_until_ready()
    with pytest.raises(AssertionError, match="traced > 1 times"):  # a new shape would trace again: the counter works
        forward(params, jnp.ones((5, 6)))


def test_jitted_train_step_with_dropout_traces_once():
    params = PARAMS

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, x, key):
        loss = lambda p: jnp.mean(mlp.apply(p, x, dropout=0.1, key=key) ** 2)  # noqa: E731
        grads = jax.grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    for i in range(4):
        params = step(params, jnp.ones((4, 6)), jax.random.key(i))


# ------------------------------------------------------------------------------------------------ errors


def test_wrong_input_feature_size_names_mlp_x_and_both_shapes():
    with pytest.raises(ValueError) as err:
        mlp.apply(PARAMS, jnp.ones((2, 5)))
    assert (
        str(err.value)
        == "mlp: x has shape (2, 5), but its axis -1 must be 6 to match params['fc']['w'] of shape (6, 12)"
    )


def test_missing_and_extra_param_keys_name_the_path():
    params = PARAMS
    with pytest.raises(KeyError, match=r"mlp: params have missing keys \['proj'\] and unexpected keys \['out'\]"):
        mlp.apply({"fc": params["fc"], "out": params["proj"]}, jnp.ones((2, 6)))
    with pytest.raises(KeyError, match=r"mlp.proj: params have missing keys \['w'\] and unexpected keys \['kernel'\]"):
        mlp.apply({"fc": params["fc"], "proj": {"kernel": params["proj"]["w"]}}, jnp.ones((2, 6)))


def test_int_input_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError) as err:
        mlp.apply(PARAMS, jnp.ones((2, 6), jnp.int32))
    msg = str(err.value)
    assert "purejax.nn.mlp.apply" in msg and "parameter 'x'" in msg and "i32[2,6]" in msg and "'*batch d_in'" in msg


@pytest.mark.parametrize("d_in, d_ff, d_out", [(0, 4, None), (4, 0, None), (4, 8, 0), (4, 8, -2)])
def test_impossible_sizes(d_in, d_ff, d_out):
    with pytest.raises(ValueError, match="linear.init: d_in and d_out must be positive"):
        jax.eval_shape(lambda k: mlp.init(k, d_in, d_ff, d_out), KEY)  # raised while tracing; nothing compiled


def test_impossible_dropout_rate():
    params = PARAMS
    with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\), got 1.0"):
        mlp.apply(params, jnp.ones((2, 6)), dropout=1.0, key=jax.random.key(0))
