"""Layer normalisation (Ba et al. 2016): normalise the last axis to zero mean and unit variance, then scale
and shift. Computed in float32 whatever the input dtype, and returned in the input dtype.

params: {"scale": (d_model,), "bias": (d_model,)}; "bias" is absent when bias=False (nanoGPT's `bias=False` option).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn._check import check_dim, check_keys

Params = dict[str, Array]


def init(key: PRNGKeyArray | None, d_model: int, *, bias: bool = True, dtype: Any = jnp.float32) -> Params:
    """scale ones, bias zeros. `key` is unused; every init takes one so all layers compose the same way."""
    del key
    if d_model <= 0:
        raise ValueError(f"layer_norm.init: d_model must be positive, got {d_model}")
    params = {"scale": jnp.ones((d_model,), dtype)}
    if bias:
        params["bias"] = jnp.zeros((d_model,), dtype)
    return params


def apply(
    params: Params, x: Float[ArrayLike, "*batch d_model"], *, eps: float = 1e-5
) -> Float[Array, "*batch d_model"]:
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis; biased variance, eps 1e-5, as torch."""
    x = jnp.asarray(x)
    check_keys(params, "layer_norm", required=("scale",), optional=("bias",))
    check_dim("layer_norm", "x", x, -1, params["scale"].shape[0], f"params['scale'] of shape {params['scale'].shape}")
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * params["scale"].astype(x32.dtype)
    if "bias" in params:
        y = y + params["bias"].astype(x32.dtype)
    return y.astype(x.dtype)
