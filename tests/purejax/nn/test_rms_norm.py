"""purejax.nn.rms_norm against float64 numpy: values, low-precision inputs (computed in float32, returned in the
input dtype), gradients, and the errors for bad params, shapes and dtypes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from purejax.nn import rms_norm


def reference(x, scale, eps=1e-6):
    """float64 numpy RMS norm (Zhang & Sennrich 2019): no mean subtraction, no bias."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def reference_grads(x, scale, dy, eps=1e-6):
    """Analytic float64 gradients of sum(dy * rms_norm(x)) with respect to x and scale."""
    x, scale, dy = (np.asarray(a, np.float64) for a in (x, scale, dy))
    r = 1 / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    g = dy * scale
    dx = r * g - x * r**3 * (g * x).mean(-1, keepdims=True)
    return dx, (dy * x * r).sum(tuple(range(x.ndim - 1)))


def random_scale(d, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 0.3, d), jnp.float32)


def test_init():
    chex.assert_trees_all_equal(rms_norm.init(None, 5), {"scale": jnp.ones(5)})
    assert rms_norm.init(jax.random.key(0), 5, dtype=jnp.bfloat16)["scale"].dtype == jnp.bfloat16


apply_jit = jax.jit(rms_norm.apply)


@settings(max_examples=10, deadline=None)
@given(
    batch=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    d=st.integers(1, 48),
    magnitude=st.floats(1e-2, 1e3),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_numpy_for_random_shapes(batch, d, magnitude, seed):
    x = (magnitude * np.random.default_rng(seed).normal(size=(*batch, d))).astype(np.float32)
    params = {"scale": random_scale(d, seed)}
    y = apply_jit(params, jnp.asarray(x))
    chex.assert_shape(y, (*batch, d))
    np.testing.assert_allclose(y, reference(x, params["scale"]), rtol=1e-5, atol=1e-5)


def test_eps_matters_for_small_inputs():
    x = np.full((1, 4), 1e-3, np.float32)  # mean square 1e-6 = eps
    y = rms_norm.apply(rms_norm.init(None, 4), jnp.asarray(x))
    np.testing.assert_allclose(y, np.full((1, 4), 1 / np.sqrt(2)), rtol=1e-5)
    np.testing.assert_allclose(
        rms_norm.apply(rms_norm.init(None, 4), jnp.asarray(x), eps=0.0), np.ones((1, 4)), rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_input_is_normalised_in_float32_and_returned_in_its_dtype(dtype):
    # |x| ~ 500: x^2 overflows float16 (max 65504), so this passes only if the mean square is taken in float32.
    x = (500 * np.random.default_rng(1).normal(size=(4, 384))).astype(np.float32)
    x_low = jnp.asarray(x, dtype)
    params = {"scale": random_scale(384)}
    y = rms_norm.apply(params, x_low)
    assert y.dtype == dtype
    want = reference(np.asarray(x_low, np.float64), params["scale"])
    eps = float(jnp.finfo(dtype).eps)  # one rounding of the float32 result to the low dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=eps, atol=eps)


def test_gradients_match_analytic_float64():
    rng = np.random.default_rng(2)
    x = rng.normal(0.5, 2.0, size=(3, 2, 16)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    params = {"scale": random_scale(16)}

    def loss(params, x):
        return jnp.sum(rms_norm.apply(params, x) * dy)

    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(x))
    dx, dscale = reference_grads(x, params["scale"], dy)
    np.testing.assert_allclose(g_x, dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_params["scale"], dscale, rtol=1e-4, atol=1e-5)


def test_analytic_reference_gradient_agrees_with_finite_differences():
    rng = np.random.default_rng(3)
    x, scale, dy = rng.normal(size=(2, 6)), rng.normal(size=6), rng.normal(size=(2, 6))
    dx, dscale = reference_grads(x, scale, dy)
    h = 1e-6
    numeric_dx = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        numeric_dx[idx] = np.sum(dy * (reference(x + e, scale) - reference(x - e, scale))) / (2 * h)
    numeric_dscale = np.array(
        [np.sum(dy * (reference(x, scale + h * e) - reference(x, scale - h * e))) / (2 * h) for e in np.eye(6)]
    )
    np.testing.assert_allclose(dx, numeric_dx, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dscale, numeric_dscale, rtol=1e-6, atol=1e-8)


class RmsNormVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_same_result_with_and_without_jit(self):
        x = np.random.default_rng(4).normal(size=(2, 3, 8)).astype(np.float32)
        params = {"scale": random_scale(8)}
        y = self.variant(rms_norm.apply)(params, jnp.asarray(x))
        chex.assert_shape(y, (2, 3, 8))
        chex.assert_trees_all_close(y, reference(x, params["scale"]).astype(np.float32), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors


def test_int_input_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError) as err:
        rms_norm.apply(rms_norm.init(None, 4), jnp.ones((3, 4), jnp.int32))
    msg = str(err.value)
    assert "parameter 'x'" in msg and "i32[3,4]" in msg and "'*batch d_model'" in msg


def test_wrong_feature_size_names_the_argument_and_both_shapes():
    with pytest.raises(ValueError) as err:
        rms_norm.apply(rms_norm.init(None, 4), jnp.ones((2, 5)))
    assert (
        str(err.value)
        == "rms_norm: x has shape (2, 5), but its axis -1 must be 4 to match params['scale'] of shape (4,)"
    )


def test_missing_and_extra_param_keys():
    with pytest.raises(KeyError, match=r"rms_norm: params have missing keys \[\] and unexpected keys \['bias'\]"):
        rms_norm.apply({"scale": jnp.ones(4), "bias": jnp.zeros(4)}, jnp.ones((2, 4)))
    with pytest.raises(KeyError, match=r"missing keys \['scale'\]"):
        rms_norm.apply({"weight": jnp.ones(4)}, jnp.ones((2, 4)))
    with pytest.raises(TypeError):  # not a dict at all (beartype's Params check, or the layer's own)
        rms_norm.apply([jnp.ones(4)], jnp.ones((2, 4)))


@pytest.mark.parametrize("d", [0, -1])
def test_impossible_size(d):
    with pytest.raises(ValueError, match=f"rms_norm.init: d_model must be positive, got {d}"):
        rms_norm.init(None, d)
