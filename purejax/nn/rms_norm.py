"""RMS normalisation (Zhang & Sennrich 2019): divide the last axis by its root mean square, then scale.
No mean subtraction and no bias. Computed in float32, returned in the input dtype.

params: {"scale": (d_model,)}
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn._check import check_dim, check_keys

Params = dict[str, Array]


def init(key: PRNGKeyArray | None, d_model: int, *, dtype: Any = jnp.float32) -> Params:
    """scale ones. `key` is unused; every init takes one so all layers compose the same way."""
    del key
    if d_model <= 0:
        raise ValueError(f"rms_norm.init: d_model must be positive, got {d_model}")
    return {"scale": jnp.ones((d_model,), dtype)}


def apply(
    params: Params, x: Float[ArrayLike, "*batch d_model"], *, eps: float = 1e-6
) -> Float[Array, "*batch d_model"]:
    """x / sqrt(mean(x^2) + eps) * scale over the last axis."""
    x = jnp.asarray(x)
    check_keys(params, "rms_norm", required=("scale",))
    check_dim("rms_norm", "x", x, -1, params["scale"].shape[0], f"params['scale'] of shape {params['scale'].shape}")
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * params["scale"].astype(x32.dtype)).astype(x.dtype)
