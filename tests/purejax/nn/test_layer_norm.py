"""purejax.nn.layer_norm against float64 numpy: values for random shapes, low-precision inputs (computed in
float32, returned in the input dtype), gradients, forward-mode and second derivatives of the written-out
derivative, and the errors for bad params, shapes and dtypes.

This file also holds THE typing test of the issue: under the test suite's jaxtyping + beartype import hook, a
wrong dtype or rank fails at the call with a TypeCheckError naming the argument, the annotation and the actual
shape; a wrong feature size fails with a ValueError naming the argument and both shapes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from purejax.nn import layer_norm


def reference(x, scale, bias=None, eps=1e-5):
    """float64 numpy layer norm: biased variance, as torch.nn.LayerNorm."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(scale, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def reference_grads(x, scale, dy, eps=1e-5):
    """Analytic float64 gradients of sum(dy * layer_norm(x)) with respect to x, scale and bias."""
    x, scale, dy = (np.asarray(a, np.float64) for a in (x, scale, dy))
    sigma = np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - x.mean(-1, keepdims=True)) / sigma
    g = dy * scale
    dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) / sigma
    batch_axes = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(batch_axes), dy.sum(batch_axes)


def random_params(d, seed=0):
    rng = np.random.default_rng(seed)
    scale, bias = rng.normal(1.0, 0.3, d), rng.normal(0.0, 0.3, d)
    return {"scale": jnp.asarray(scale, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}


def test_init():
    params = layer_norm.init(None, 6)
    chex.assert_trees_all_equal(params, {"scale": jnp.ones(6), "bias": jnp.zeros(6)})
    assert set(layer_norm.init(jax.random.key(0), 6, bias=False)) == {"scale"}
    assert layer_norm.init(None, 6, dtype=jnp.bfloat16)["scale"].dtype == jnp.bfloat16


apply_jit = jax.jit(layer_norm.apply)


@settings(max_examples=12, deadline=None)
@given(
    batch=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    d=st.integers(1, 48),
    offset=st.floats(-100, 100),
    spread=st.floats(0.01, 100),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_numpy_for_random_shapes(batch, d, offset, spread, seed):
    rng = np.random.default_rng(seed)
    x = (offset + spread * rng.normal(size=(*batch, d))).astype(np.float32)
    params = random_params(d, seed)
    y = apply_jit(params, jnp.asarray(x))  # one compile per shape: much cheaper than op-by-op for each example
    chex.assert_shape(y, (*batch, d))
    assert y.dtype == jnp.float32
    want = reference(x, params["scale"], params["bias"])
    # float32 cancellation in x - mean costs about |offset| / spread ulps; the tolerance follows that
    tol = 1e-5 * (1 + abs(offset) / spread)
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol)


def test_without_bias_and_custom_eps():
    x = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32) * 1e-2  # var ~ eps: eps matters
    params = random_params(5)
    del params["bias"]
    y = layer_norm.apply(params, jnp.asarray(x), eps=1e-3)
    np.testing.assert_allclose(y, reference(x, params["scale"], eps=1e-3), rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, reference(x, params["scale"], eps=1e-5), rtol=1e-2)


def test_constant_rows_give_the_bias():
    params = random_params(4)
    y = layer_norm.apply(params, jnp.full((2, 4), 7.0))
    np.testing.assert_allclose(y, np.broadcast_to(params["bias"], (2, 4)), atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_input_is_normalised_in_float32_and_returned_in_its_dtype(dtype):
    # Values around 300 with spread 200: squares overflow float16 (max 65504) and bf16 sums lose most digits,
    # so this passes only if the statistics are computed in float32.
    x = (300 + 200 * np.random.default_rng(2).normal(size=(4, 384))).astype(np.float32)
    x_low = jnp.asarray(x, dtype)
    params = random_params(384)
    y = layer_norm.apply(params, x_low)
    assert y.dtype == dtype
    want = reference(np.asarray(x_low, np.float64), params["scale"], params["bias"])
    eps = float(jnp.finfo(dtype).eps)  # one rounding of the float32 result to the low dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=eps, atol=eps)


def test_low_precision_params_with_float32_input():
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), random_params(8))
    x = np.random.default_rng(3).normal(size=(2, 8)).astype(np.float32)
    y = layer_norm.apply(params, jnp.asarray(x))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, reference(x, params["scale"], params["bias"]), rtol=1e-5, atol=1e-5)


def test_gradients_match_analytic_float64():
    rng = np.random.default_rng(4)
    x = rng.normal(2.0, 3.0, size=(3, 2, 16)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    params = random_params(16)

    def loss(params, x):
        return jnp.sum(layer_norm.apply(params, x) * dy)

    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(x))
    dx, dscale, dbias = reference_grads(x, params["scale"], dy)
    np.testing.assert_allclose(g_x, dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_params["scale"], dscale, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_params["bias"], dbias, rtol=1e-5, atol=1e-5)


def test_analytic_reference_gradient_agrees_with_finite_differences():
    """Checks the reference used above, so that the gradient test does not rest on an unchecked formula."""
    rng = np.random.default_rng(5)
    x, scale, dy = rng.normal(size=(2, 7)), rng.normal(size=7), rng.normal(size=(2, 7))
    dx, dscale, _ = reference_grads(x, scale, dy)
    h = 1e-6
    numeric_dx = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        numeric_dx[idx] = np.sum(dy * (reference(x + e, scale) - reference(x - e, scale))) / (2 * h)
    numeric_dscale = np.array(
        [np.sum(dy * (reference(x, scale + h * e) - reference(x, scale - h * e))) / (2 * h) for e in np.eye(7)]
    )
    np.testing.assert_allclose(dx, numeric_dx, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dscale, numeric_dscale, rtol=1e-6, atol=1e-8)


def test_forward_mode_derivative_matches_float64_finite_differences():
    """The written-out derivative (a custom JVP) in forward mode: jax.jvp against central differences of the
    float64 reference, for tangents of x, scale and bias at once."""
    rng = np.random.default_rng(7)
    x, dx = rng.normal(1.0, 2.0, size=(2, 3, 9)), rng.normal(size=(2, 3, 9))
    params, tangents = random_params(9, seed=7), random_params(9, seed=8)
    _, got = jax.jvp(layer_norm.apply, (params, jnp.asarray(x, jnp.float32)), (tangents, jnp.asarray(dx, jnp.float32)))
    h = 1e-6
    p, t = ({k: np.asarray(v, np.float64) for k, v in d.items()} for d in (params, tangents))
    plus = reference(x + h * dx, p["scale"] + h * t["scale"], p["bias"] + h * t["bias"])
    minus = reference(x - h * dx, p["scale"] - h * t["scale"], p["bias"] - h * t["bias"])
    np.testing.assert_allclose(got, (plus - minus) / (2 * h), rtol=1e-4, atol=1e-4)


def test_second_derivative_matches_float64_finite_differences():
    """The derivative rule is itself differentiable: a Hessian-vector product of sum(dy * layer_norm(x)) in x
    against central differences of the analytic float64 gradient."""
    rng = np.random.default_rng(8)
    x, v, dy = rng.normal(size=(4, 6)), rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    params = random_params(6, seed=9)

    def grad_x(x):
        return jax.grad(lambda x: jnp.sum(layer_norm.apply(params, x) * dy))(x)

    _, hvp = jax.jvp(grad_x, (jnp.asarray(x, jnp.float32),), (jnp.asarray(v, jnp.float32),))
    h = 1e-5
    scale = np.asarray(params["scale"], np.float64)
    want = (reference_grads(x + h * v, scale, dy)[0] - reference_grads(x - h * v, scale, dy)[0]) / (2 * h)
    np.testing.assert_allclose(hvp, want, rtol=1e-3, atol=1e-4)


def test_x_gradient_ends_in_one_product():
    """Why the derivative is written out (module docstring): x's gradient must come out of one product by the
    per-row 1 / sqrt(var + eps), not out of a sum with a broadcast term, which XLA:CPU recomputes in every
    kernel that reads it. Read from the jaxpr of the VJP: the op that produces the gradient."""
    params = random_params(8)

    def vjp(x, g):
        return jax.vjp(lambda x: layer_norm.apply(params, x), x)[1](g)[0]

    jaxpr = jax.make_jaxpr(vjp)(jnp.ones((2, 3, 8)), jnp.ones((2, 3, 8))).jaxpr
    (producer,) = [eqn for eqn in jaxpr.eqns if jaxpr.outvars[0] in eqn.outvars]
    assert producer.primitive.name == "mul"


class LayerNormVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_same_result_with_and_without_jit(self):
        x = np.random.default_rng(6).normal(size=(5, 12)).astype(np.float32)
        params = random_params(12)
        y = self.variant(layer_norm.apply)(params, jnp.asarray(x))
        chex.assert_shape(y, (5, 12))
        want = reference(x, params["scale"], params["bias"]).astype(np.float32)
        chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors


def test_typing_wrong_dtype_fails_at_the_call_naming_the_argument():
    """The issue's typing test: int input to a float layer fails at the call, naming `x`, the expected
    annotation and the actual dtype and shape (jaxtyping + beartype, installed by tests/conftest.py)."""
    params = layer_norm.init(None, 4)
    with pytest.raises(TypeCheckError) as err:
        layer_norm.apply(params, jnp.ones((2, 4), jnp.int32))
    msg = str(err.value)
    assert "purejax.nn.layer_norm.apply" in msg
    assert "parameter 'x'" in msg
    assert "i32[2,4]" in msg  # actual dtype and shape
    assert "Float[" in msg and "'*batch d_model'" in msg  # expected dtype and shape


def test_typing_wrong_rank_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError) as err:
        layer_norm.apply(layer_norm.init(None, 4), jnp.float32(1.0))
    msg = str(err.value)
    assert "parameter 'x'" in msg and "f32[]" in msg and "'*batch d_model'" in msg


def test_wrong_feature_size_names_the_argument_and_both_shapes():
    with pytest.raises(ValueError) as err:
        layer_norm.apply(layer_norm.init(None, 4), jnp.ones((2, 3)))
    msg = str(err.value)
    assert msg.startswith("layer_norm: x has shape (2, 3)")
    assert "must be 4" in msg and "params['scale'] of shape (4,)" in msg


def test_wrong_feature_size_fails_under_jit_too():
    with pytest.raises(ValueError, match=r"layer_norm: x has shape \(2, 3\)"):
        jax.jit(layer_norm.apply)(layer_norm.init(None, 4), jnp.ones((2, 3)))


def test_missing_and_extra_param_keys():
    with pytest.raises(KeyError, match=r"missing keys \['scale'\] and unexpected keys \['gamma'\]"):
        layer_norm.apply({"gamma": jnp.ones(4), "bias": jnp.zeros(4)}, jnp.ones((2, 4)))
    with pytest.raises(KeyError, match=r"unexpected keys \['beta'\]; expected \['scale'\] and optionally \['bias'\]"):
        layer_norm.apply({"scale": jnp.ones(4), "beta": jnp.zeros(4)}, jnp.ones((2, 4)))


@pytest.mark.parametrize("d", [0, -3])
def test_impossible_size(d):
    with pytest.raises(ValueError, match=f"layer_norm.init: d_model must be positive, got {d}"):
        layer_norm.init(None, d)
