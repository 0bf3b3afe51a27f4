"""An exponential moving average of the *parameters*, for evaluation and sampling (Polyak averaging).

    ema = param_ema(0.999)
    ema_state = ema.init(params)
    ema_state = ema.update(ema_state, params)     # after each optimizer step
    eval_params = ema.value(ema_state)

Not to be confused with `optax.ema`, a gradient transformation that averages the *updates* flowing through an
optimizer (a momentum). Hence the name `param_ema`, and a separate (state, params) -> state pair rather than a
gradient transformation.

Two ways to handle the start: by default the average starts at the initial parameters (no bias; with a decay
of 0.9999 it then forgets the random initialisation slowly, so pair it with `ema_warmup`); with `debias=True` it
starts at zero and `value` divides by `1 - decay**count`, as Adam does for its moments.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Int

from purejax.optim.base import PyTree, Schedule, bias_correction, safe_increment, zero_count


class ParamEMAState(NamedTuple):
    """Updates made, and the running average of the parameters (the params' structure)."""

    count: Int[Array, ""]
    average: PyTree


class ParamEMA(NamedTuple):
    """`init(params) -> state`, `update(state, params) -> state`, `value(state) -> averaged params`."""

    init: Callable[[PyTree], ParamEMAState]
    update: Callable[[ParamEMAState, PyTree], ParamEMAState]
    value: Callable[[ParamEMAState], PyTree]


def ema_warmup(decay: ArrayLike, offset: ArrayLike = 10.0) -> Schedule:
    """`min(decay, (1 + count) / (offset + count))`: a decay that starts near 0.1 and rises to `decay`, so the
    average follows the fast-moving early parameters (TensorFlow's `ExponentialMovingAverage(num_updates=...)`,
    diffusers' `EMAModel` default)."""
    return lambda count: jnp.minimum(decay, (1.0 + count) / (offset + count))


def param_ema(decay: ArrayLike | Schedule, debias: bool = False, dtype: DTypeLike | None = None) -> ParamEMA:
    """A moving average `average = (1 - d) * params + d * average` with `d = decay` (or `decay(count)`).

    Arguments:
        decay: the decay per update, e.g. 0.999 (an effective window of ~1000 steps), or a schedule of the count
            such as `ema_warmup(0.9999)`.
        debias: start from zeros and divide by `1 - decay**count` in `value`; needs a constant decay.
        dtype: dtype of the average; default: float32 for float16 and bfloat16 parameters (in bfloat16,
            0.999 * a + 0.001 * p rounds back to a: the average would never move), else each parameter's own.
            `value` returns the average in this dtype.
    """
    if debias and callable(decay):
        raise ValueError("param_ema(debias=True) needs a constant decay; a warmup schedule already avoids the bias")

    def init(params: PyTree) -> ParamEMAState:
        # A copy, never the params' own buffers: a train state holding both would be donated twice.
        start = jnp.zeros_like if debias else jnp.copy
        average = jax.tree_util.tree_map(lambda p: start(p).astype(dtype or _wide(p.dtype)), params)
        return ParamEMAState(zero_count(), average)

    def update(state: ParamEMAState, params: PyTree) -> ParamEMAState:
        d = decay(state.count) if callable(decay) else decay  # a Python float stays one: 1 - d rounds as optax's
        # p in the average's dtype first: a weakly typed `1 - d` times a bfloat16 p would round the product to
        # bfloat16 (0.01 becomes 0.010009765625), and the average of a constant 1.0 would settle at 1.00097.
        average = jax.tree_util.tree_map(
            lambda p, a: ((1 - d) * p.astype(a.dtype) + d * a).astype(a.dtype), params, state.average
        )
        return ParamEMAState(safe_increment(state.count), average)

    def value(state: ParamEMAState) -> PyTree:
        if not debias:
            return state.average
        corrected = bias_correction(state.average, decay, state.count)  # 0 / 0 before the first update
        return jax.tree_util.tree_map(lambda c, a: jnp.where(state.count > 0, c, a), corrected, state.average)

    return ParamEMA(init, update, value)


def _wide(dtype: DTypeLike) -> DTypeLike:
    """float32 for the 16-bit floats, the dtype itself otherwise."""
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 else dtype
