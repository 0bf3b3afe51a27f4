"""purejax.nn.activations against float64 formulas written out with `math` (not jax.nn), dtype preservation,
gradients of GELU, and lookup by name."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import activations

X = np.concatenate([np.linspace(-12, 12, 481), [-1e-4, 0.0, 1e-4, 5.999, 6.0, 6.001, 30.0, -30.0]])


def gelu_exact(x):
    return x * 0.5 * (1 + math.erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


REFERENCES = {
    "relu": lambda x: max(x, 0.0),
    "relu6": lambda x: min(max(x, 0.0), 6.0),
    "gelu": gelu_exact,
    "gelu_tanh": gelu_tanh,
    "silu": lambda x: x * sigmoid(x),
    "sigmoid": sigmoid,
    "tanh": math.tanh,
    "identity": lambda x: x,
}


def test_every_activation_has_a_reference():
    assert set(REFERENCES) == set(activations.BY_NAME)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_matches_float64_formula(name):
    fn = activations.get(name)
    got = np.asarray(fn(jnp.asarray(X, jnp.float32)), np.float64)
    want = np.array([REFERENCES[name](float(np.float32(x))) for x in X])
    # tanh GELU in float32: 1 + tanh(u) cancels to 0 for x < -5, where the true value is below 5e-7 in size
    atol = 1e-6 if name == "gelu_tanh" else 1e-7
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=atol)


def test_exact_and_tanh_gelu_differ():
    """The two GELUs must not be the same function by mistake: they differ by up to ~5e-4 around |x| = 2."""
    x = jnp.asarray(X, jnp.float32)
    gap = np.max(np.abs(activations.gelu(x) - activations.gelu_tanh(x)))
    assert 1e-4 < gap < 1e-3


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_keeps_the_input_dtype(name, dtype):
    x = jnp.linspace(-8, 8, 33, dtype=dtype)
    y = activations.get(name)(x)
    assert y.dtype == dtype and y.shape == x.shape
    want = np.array([REFERENCES[name](float(v)) for v in np.asarray(x, np.float64)])
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 * float(jnp.finfo(dtype).eps), atol=1e-2)


def test_gelu_gradients_match_float64_derivatives():
    x = np.linspace(-5, 5, 41)
    pdf = np.exp(-(x**2) / 2) / math.sqrt(2 * math.pi)
    cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    grad = jax.jit(jax.vmap(jax.grad(activations.gelu)))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(grad, cdf + x * pdf, rtol=1e-5, atol=1e-6)

    c = math.sqrt(2 / math.pi)
    inner = c * (x + 0.044715 * x**3)
    want = 0.5 * (1 + np.tanh(inner)) + 0.5 * x * (1 - np.tanh(inner) ** 2) * c * (1 + 3 * 0.044715 * x**2)
    grad = jax.jit(jax.vmap(jax.grad(activations.gelu_tanh)))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=5e-6)  # the same float32 cancellation below x = -4


def test_relu6_gradient_is_one_inside_and_zero_outside():
    grad = jax.jit(jax.vmap(jax.grad(activations.relu6)))(jnp.array([-1.0, 0.5, 3.0, 5.5, 7.0]))
    np.testing.assert_array_equal(grad, [0.0, 1.0, 1.0, 1.0, 0.0])


def test_get_unknown_name_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown activation 'swish'; valid: \['gelu', 'gelu_tanh', 'identity', 'relu'"
    ):
        activations.get("swish")


def test_int_input_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        activations.gelu(jnp.arange(3))


def test_gelu_differentiates_inside_shard_map():
    """Inside `shard_map(check_vma=True)` the gradient of exact GELU with respect to a replicated weight must
    trace and equal the one-device gradient. JAX's own erf derivative fails there from jax 0.12 (its polynomial
    coefficients are not varying over the mesh axis); `activations.gelu` writes its derivative out."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jnp.linspace(-3.0, 3.0, 8)

    def loss(w, x):
        return jnp.sum(activations.gelu(x * w))

    def sharded_grad(w, x):
        return jax.lax.psum(jax.grad(loss)(w, x), "data")

    step = jax.jit(jax.shard_map(sharded_grad, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=True))
    np.testing.assert_allclose(step(jnp.float32(0.7), x), jax.grad(loss)(jnp.float32(0.7), x), rtol=1e-6)
