"""Layer normalisation (Ba et al. 2016): normalise the last axis to zero mean and unit variance, then scale
and shift. Computed in float32 whatever the input dtype, and returned in the input dtype.

params: {"scale": (d_model,), "bias": (d_model,)}; "bias" is absent when bias=False (nanoGPT's `bias=False` option).

The derivative is written out (a custom JVP): the same values as JAX's own up to float rounding, arranged for
XLA. Differentiated as written, x's gradient ends in a sum with a per-row term broadcast over the features. In a
residual stack (x + f(layer_norm(x)), layer after layer) that sum is where each layer's residual gradient is
formed, and XLA fuses an op whose other operands are broadcasts into every consumer that can take it, even if it
must then compute it several times: each layer's gradient was recomputed, from the top of the network down, by
every kernel that read it. Scaling the tangent by 1 / sqrt(var + eps) first makes the transpose end in one
product by that factor, and the residual gradient a sum of two full arrays, which XLA computes once and stores.
In a GPT training step on CPU that cut the elementwise work by a quarter to a third (docs/benchmarks.md).
"""

import functools
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
    y = _normalize(x32, params["scale"].astype(x32.dtype), eps)
    if "bias" in params:
        y = y + params["bias"].astype(x32.dtype)
    return y.astype(x.dtype)


def _standardize(
    x: Float[Array, "*batch d_model"], eps: float
) -> tuple[Float[Array, "*batch d_model"], Float[Array, "*batch 1"]]:
    """(x - mean) / sqrt(var + eps) over the last axis, and 1 / sqrt(var + eps)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    inv_std = jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + eps)
    return (x - mean) * inv_std, inv_std


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _normalize(
    x: Float[Array, "*batch d_model"], scale: Float[Array, " d_model"], eps: float
) -> Float[Array, "*batch d_model"]:
    """The standardized x times scale; its derivative is written out below (see the module docstring)."""
    return _standardize(x, eps)[0] * scale


@_normalize.defjvp
def _normalize_jvp(eps, primals, tangents):
    """d(xhat) = (u - mean(u) - xhat * mean(u * xhat)) with u = dx / sqrt(var + eps): the tangent scaled by the
    per-row factor first, so that the transpose (x's gradient) ends in one product by it."""
    (x, scale), (dx, dscale) = primals, tangents
    xhat, inv_std = _standardize(x, eps)
    u = inv_std * dx
    dxhat = u - jnp.mean(u, axis=-1, keepdims=True) - xhat * jnp.mean(u * xhat, axis=-1, keepdims=True)
    return xhat * scale, dxhat * scale + xhat * dscale
