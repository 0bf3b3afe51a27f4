"""Stochastic gradient descent with optional heavy-ball or Nesterov momentum.

Momentum in the form torch and optax use (no dampening): `trace = g + momentum * trace`, and the update is the
trace, or with Nesterov `g + momentum * trace` (Sutskever et al. 2013), then scaled by the learning rate.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import ArrayLike

from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain
from purejax.optim.learning_rate import scale_by_learning_rate


class TraceState(NamedTuple):
    """The momentum buffer, one array per parameter."""

    trace: PyTree


def trace(
    decay: ArrayLike, nesterov: bool = False, accumulator_dtype: DTypeLike | None = None
) -> GradientTransformation:
    """Momentum: keep `trace = updates + decay * trace` and emit it (or, with `nesterov`, look one step ahead).

    Arguments:
        decay: the momentum coefficient (torch's `momentum`), typically 0.9.
        nesterov: emit `updates + decay * trace` instead of the trace.
        accumulator_dtype: the buffer's dtype (e.g. bfloat16 to halve its memory; optax's name); default: each
            parameter's dtype. The update is computed before the buffer is rounded to it.
    """

    def init(params: PyTree) -> TraceState:
        return TraceState(jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=accumulator_dtype), params))

    def update(updates: PyTree, state: TraceState, params: PyTree = None) -> tuple[PyTree, TraceState]:
        del params
        new_trace = jax.tree_util.tree_map(lambda g, t: g + decay * t, updates, state.trace)
        if nesterov:
            updates = jax.tree_util.tree_map(lambda g, t: g + decay * t, updates, new_trace)
        else:
            updates = new_trace
        return updates, TraceState(jax.tree_util.tree_map(lambda t, old: t.astype(old.dtype), new_trace, state.trace))

    return GradientTransformation(init, update)


def sgd(
    learning_rate: ArrayLike | Schedule,
    momentum: ArrayLike | None = None,
    nesterov: bool = False,
    accumulator_dtype: DTypeLike | None = None,
) -> GradientTransformation:
    """SGD, as `torch.optim.SGD(lr, momentum, nesterov=...)` without dampening or weight decay (chain
    `add_decayed_weights` before the learning rate for that). `accumulator_dtype`: the momentum buffer's
    dtype, as in `trace`. State paths: `momentum.trace.*`, `lr.*`."""
    if momentum is None:
        if nesterov or accumulator_dtype is not None:
            raise ValueError(
                "sgd(nesterov=True) and sgd(accumulator_dtype=...) apply to the momentum buffer: give a momentum "
                "value, e.g. momentum=0.9"
            )
        return chain(lr=scale_by_learning_rate(learning_rate))
    return chain(momentum=trace(momentum, nesterov, accumulator_dtype), lr=scale_by_learning_rate(learning_rate))
