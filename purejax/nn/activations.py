"""Activation functions. Plain functions of arrays, no parameters; pass them by name to layers that take one."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def relu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return jnp.maximum(x, 0)


def relu6(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """min(max(x, 0), 6): MobileNet's activation (Howard et al. 2017), robust in low precision."""
    return jnp.clip(x, 0, 6)


def gelu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Exact GELU, x * Phi(x) with the normal CDF via erf (torch's default `nn.GELU()`)."""
    return jax.nn.gelu(x, approximate=False)


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
