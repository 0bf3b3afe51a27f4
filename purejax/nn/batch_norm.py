"""Batch normalisation (Ioffe & Szegedy 2015) with its running statistics as explicit state.

params: {"scale": (channels,), "bias": (channels,)}, trained by the optimizer.
state:  {"mean": (channels,), "var": (channels,)}, float32, updated by `apply` in train mode and returned.

Statistics are taken over every axis but the last, the channels: batch, height and width for NHWC images, the
batch alone for (batch, channels) features. The conventions are torch's `nn.BatchNorm2d`, so imported weights
and buffers behave the same (torch calls the size `num_features`; here it is `channels`, as in `conv`):
- train: normalise with the batch mean and the *biased* batch variance, and update
  `running = (1 - momentum) * running + momentum * batch` with the *unbiased* variance (n / (n - 1));
- eval: normalise with the running statistics; the state comes back unchanged.

`apply(params, x, state, ...)` takes the state after the input and returns `(y, new_state)` in both modes,
the layer contract's order for a stateful layer (docs/design.md). `train` is a Python bool, fixed at trace
time. To choose train or eval with a traced flag, call `apply` in both branches of `lax.cond`: both return
the same state structure and dtypes.

Data parallel: with `axis_name`, the batch statistics are averaged over that named axis (`shard_map`, or
`vmap(..., axis_name=...)`), in two passes, global mean and then the global mean of squared deviations, which
equals the single-device statistics of the concatenated batch (shards must be the same size, as they are
under shard_map and vmap). Without it, each device normalises with its own shard's statistics.
"""

import math
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn._check import check_dim, check_keys, check_shape

Params = dict[str, Array]
State = dict[str, Array]


def init(key: PRNGKeyArray | None, channels: int, *, dtype: Any = jnp.float32) -> Params:
    """scale ones, bias zeros. `key` is unused; every init takes one so all layers compose the same way."""
    del key
    if channels <= 0:
        raise ValueError(f"batch_norm.init: channels must be positive, got {channels}")
    return {"scale": jnp.ones((channels,), dtype), "bias": jnp.zeros((channels,), dtype)}


def init_state(channels: int) -> State:
    """Running mean zeros and running variance ones (torch's initial buffers), in float32."""
    if channels <= 0:
        raise ValueError(f"batch_norm.init_state: channels must be positive, got {channels}")
    return {"mean": jnp.zeros((channels,), jnp.float32), "var": jnp.ones((channels,), jnp.float32)}


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch channels"],
    state: State,
    *,
    train: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    axis_name: Hashable | None = None,
) -> tuple[Float[Array, "*batch channels"], State]:
    """(y, new_state): y = (x - mean) / sqrt(var + eps) * scale + bias, computed in float32, returned in x's dtype.

    Arguments:
        train: True uses and folds in the batch statistics; False uses the running statistics.
        momentum: weight of the new batch in the running statistics (torch's convention; Flax's `momentum`
            is 1 minus this).
        axis_name: a named axis (or tuple of them) to average the batch statistics over; train mode only.
    """
    x = jnp.asarray(x)
    _check(params, state, x, momentum)
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if train:
        mean, var, count = _batch_stats(x32, axis_name)
        if count < 2:
            raise ValueError(f"batch_norm: train mode needs more than one value per channel, got x of shape {x.shape}")
        unbiased = var * (count / (count - 1))
        new_state = {
            name: ((1 - momentum) * state[name] + momentum * jax.lax.stop_gradient(batch)).astype(state[name].dtype)
            for name, batch in (("mean", mean), ("var", unbiased))
        }
    else:
        mean, var = state["mean"].astype(x32.dtype), state["var"].astype(x32.dtype)
        new_state = state
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * params["scale"].astype(x32.dtype) + params["bias"].astype(x32.dtype)
    return y.astype(x.dtype), new_state


def _batch_stats(
    x32: Float[Array, "*batch channels"], axis_name: Hashable | None
) -> tuple[Float[Array, " channels"], Float[Array, " channels"], int]:
    """Mean, biased variance and element count per channel over all axes but the last, and over `axis_name`."""
    axes = tuple(range(x32.ndim - 1))
    count = math.prod(x32.shape[:-1])
    mean = jnp.mean(x32, axis=axes)
    if axis_name is not None:
        mean = jax.lax.pmean(mean, axis_name)
    var = jnp.mean(jnp.square(x32 - mean), axis=axes)
    if axis_name is not None:
        var = jax.lax.pmean(var, axis_name)
        count *= jax.lax.axis_size(axis_name)
    return mean, var, count


def _check(params: Any, state: Any, x: Array, momentum: float) -> None:
    check_keys(params, "batch_norm", required=("scale", "bias"))
    if not isinstance(state, Mapping) or set(state) != {"mean", "var"}:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise KeyError(f"batch_norm: state must be a dict with keys ['mean', 'var'] (batch_norm.init_state), got {got}")
    if x.ndim < 2:
        raise ValueError(f"batch_norm: x must be (*batch, channels) with at least one batch axis, got shape {x.shape}")
    channels = params["scale"].shape[0]
    source = f"params['scale'] of shape {params['scale'].shape}"
    check_dim("batch_norm", "x", x, -1, channels, source)
    vectors = {"params['bias']": params["bias"], "state['mean']": state["mean"], "state['var']": state["var"]}
    for name, array in vectors.items():
        check_shape("batch_norm", name, array, (channels,), source)
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"batch_norm: momentum must be in [0, 1], got {momentum}")
