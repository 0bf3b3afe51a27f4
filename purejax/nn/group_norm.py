"""Group normalisation (Wu & He 2018): split the channels into `num_groups` groups and normalise each group of
each sample to zero mean and unit variance, over the group's channels and every spatial position; then scale
and shift each channel. Unlike batch norm it uses no batch statistics, so it needs no state and behaves the
same in training and evaluation, whatever the batch size.

params: {"scale": (channels,), "bias": (channels,)}, or {} when affine=False.

The conventions are torch's `nn.GroupNorm(num_groups, num_channels, eps=1e-5, affine=True)`: biased variance,
eps 1e-5 added to it, the scale and bias per channel (torch's `weight` and `bias`, copied as they are). The
layout is channels last: x is (*batch, *spatial, channels), with `spatial_dims` spatial axes (2 by default: NHWC
images, as `conv` and `pooling` take them) and any number of batch axes before them. Groups are contiguous
channels: group g holds channels [g * channels / num_groups, (g + 1) * channels / num_groups), as in torch.

`num_groups` is an apply option, not an init size: it sets no param's shape. num_groups == 1 normalises each
sample over all its channels and positions; num_groups == channels is instance normalisation
(`purejax.nn.instance_norm`).
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn._check import check_dim, check_keys

Params = dict[str, Array]


def init(key: PRNGKeyArray | None, channels: int, *, affine: bool = True, dtype: Any = jnp.float32) -> Params:
    """scale ones, bias zeros (torch's initial weight and bias); {} when affine=False. `key` is unused."""
    del key
    if channels <= 0:
        raise ValueError(f"group_norm.init: channels must be positive, got {channels}")
    if not affine:
        return {}
    return {"scale": jnp.ones((channels,), dtype), "bias": jnp.zeros((channels,), dtype)}


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch_and_spatial channels"],
    *,
    num_groups: int,
    eps: float = 1e-5,
    spatial_dims: int = 2,
) -> Float[Array, "*batch_and_spatial channels"]:
    """Normalise each group of channels of each sample, then scale and shift per channel (when params has them).

    Computed in float32 whatever the input dtype, and returned in the input dtype.

    Arguments:
        num_groups: how many groups the channels are split into; must divide the channel count.
        eps: added to the variance, as torch.
        spatial_dims: how many axes before the channels are spatial (statistics are taken over them); the axes
            before those are batch axes, each sample normalised on its own. 2 for images, 1 for sequences, 3
            for volumes, 0 for (*batch, channels) features.
    """
    x = jnp.asarray(x)
    check("group_norm", params, x, num_groups=num_groups, spatial_dims=spatial_dims)
    channels = x.shape[-1]
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    grouped = x32.reshape(*x.shape[:-1], num_groups, channels // num_groups)
    # the spatial axes and the channels within a group; the group axis sits between them, at x.ndim - 1
    axes = (*range(x.ndim - 1 - spatial_dims, x.ndim - 1), x.ndim)
    mean = jnp.mean(grouped, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(grouped - mean), axis=axes, keepdims=True)  # biased, as torch
    y = ((grouped - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape)
    if params:
        y = y * params["scale"].astype(y.dtype) + params["bias"].astype(y.dtype)
    return y.astype(x.dtype)


def check(layer: str, params: Params, x: Array, *, num_groups: int, spatial_dims: int) -> None:
    """Raise, naming `layer` and the argument, on params other than {} or {"scale", "bias"}, on a bad
    `spatial_dims` or `num_groups`, or on an `x` whose rank or channel count does not fit them."""
    if not isinstance(params, Mapping) or params:  # {} is a layer without scale and bias (affine=False)
        check_keys(params, layer, required=("scale", "bias"))
        check_dim(layer, "x", x, -1, params["scale"].shape[0], f"params['scale'] of shape {params['scale'].shape}")
    if not isinstance(spatial_dims, int) or spatial_dims < 0:
        raise ValueError(f"{layer}: spatial_dims must be an int >= 0, got {spatial_dims!r}")
    if x.ndim < spatial_dims + 1:
        raise ValueError(
            f"{layer}: x must be (*batch, *spatial, channels) with {spatial_dims} spatial axes, "
            f"got shape {tuple(x.shape)}"
        )
    if not isinstance(num_groups, int) or num_groups <= 0 or x.shape[-1] % num_groups:
        raise ValueError(
            f"{layer}: num_groups must be a positive int that divides the channels, got num_groups={num_groups!r} "
            f"for x of shape {tuple(x.shape)} ({x.shape[-1]} channels)"
        )
