"""Instance normalisation (Ulyanov et al. 2016): normalise each channel of each sample over its spatial
positions. It is group normalisation with one channel per group, and is computed by `group_norm.apply`.

params: {} by default, or {"scale": (channels,), "bias": (channels,)} with affine=True.

The defaults are torch's `nn.InstanceNorm2d(num_features, eps=1e-5, affine=False, track_running_stats=False)`:
no learned scale and bias unless asked for, and no running statistics, so training and evaluation are the
same. (torch's `track_running_stats=True`, which keeps batch-norm-like buffers for evaluation, is not offered.)
Channels last, as in `group_norm`: x is (*batch, *spatial, channels) with `spatial_dims` spatial axes.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn import group_norm

Params = dict[str, Array]


def init(key: PRNGKeyArray | None, channels: int, *, affine: bool = False, dtype: Any = jnp.float32) -> Params:
    """{} (torch's default, affine=False), or scale ones and bias zeros with affine=True. `key` is unused."""
    if channels <= 0:
        raise ValueError(f"instance_norm.init: channels must be positive, got {channels}")
    return group_norm.init(key, channels, affine=affine, dtype=dtype)


def apply(
    params: Params, x: Float[ArrayLike, "*batch_and_spatial channels"], *, eps: float = 1e-5, spatial_dims: int = 2
) -> Float[Array, "*batch_and_spatial channels"]:
    """(x - mean) / sqrt(var + eps) per sample and channel, over the `spatial_dims` axes before the channels
    (biased variance, as torch), then scale and shift when params has them. Returned in the input dtype."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("instance_norm: x must be (*batch, *spatial, channels), got a scalar")
    # one group per channel: num_groups always divides, so the checks below can only fail on params or x
    group_norm.check("instance_norm", params, x, num_groups=x.shape[-1], spatial_dims=spatial_dims)
    return group_norm.apply(params, x, num_groups=x.shape[-1], eps=eps, spatial_dims=spatial_dims)
