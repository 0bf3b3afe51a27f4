"""Activation functions. Plain functions of arrays, no parameters; pass them by name to layers that take one."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def relu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return jnp.maximum(x, 0)


def relu6(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """min(max(x, 0), 6): MobileNet's activation (Howard et al. 2017), robust in low precision."""
    return jnp.clip(x, 0, 6)


@jax.custom_jvp
def gelu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Exact GELU, x * Phi(x) with the normal CDF via erf (torch's default `nn.GELU()`).

    The derivative, Phi(x) + x * phi(x), is written out (`_gelu_jvp`) rather than left to JAX: from jax 0.12,
    JAX's erf is a polynomial whose constant coefficients are not cast to the input's varying mesh axes, so
    differentiating it inside `jax.shard_map(..., check_vma=True)` fails. The forward value is JAX's own."""
    return jax.nn.gelu(x, approximate=False)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    """x / 2 * erfc(-x / sqrt(2)), as jax.nn.gelu, and its tangent erfc / 2 * dx + x * phi(x) * dx.

    The first term multiplies dx by erfc's own output, not by Phi = erfc / 2 nor by one folded factor: XLA:CPU
    then keeps erfc's output from the forward pass and reads it in the backward one. Written as
    (Phi(x) + x * phi(x)) * dx, or as Phi(x) * dx + ..., the backward pass recomputed erfc's polynomial (about
    85 M of a GPT training step's 335 M elementwise operations at docs/benchmarks.md's baby config)."""
    (x,), (dx,) = primals, tangents
    erfc = jax.lax.erfc(-x * np.sqrt(0.5).astype(x.dtype))  # 2 * Phi(x)
    half_x_pdf = 0.5 * x * jnp.exp(-0.5 * x * x) * np.asarray(math.sqrt(2 / math.pi), x.dtype)  # x * phi(x)
    return 0.5 * x * erfc, 0.5 * (erfc * dx) + half_x_pdf * dx


def gelu_tanh(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """GELU with the tanh approximation of Hendrycks & Gimpel 2016, as in GPT-2 (torch's approximate='tanh')."""
    return jax.nn.gelu(x, approximate=True)


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """x * sigmoid(x), also called swish (DiT's adaLN and timestep MLPs)."""
    return x * jax.nn.sigmoid(x)


def sigmoid(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return jax.nn.sigmoid(x)


def tanh(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return jnp.tanh(x)


def identity(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return x


BY_NAME = {
    "relu": relu,
    "relu6": relu6,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "sigmoid": sigmoid,
    "tanh": tanh,
    "identity": identity,
}


def get(name: str):
    """The activation called `name` (for configs, which hold names rather than functions)."""
    if name not in BY_NAME:
        raise ValueError(f"unknown activation {name!r}; valid: {sorted(BY_NAME)}")
    return BY_NAME[name]
