"""The learning rate as the last step of an optimizer, with its current value kept in the optimizer state.

`scale_by_learning_rate(lr)` multiplies updates by `-lr` (descent). The value it used is stored in its state
(a float32 scalar), so a training loop can log it, and a constant rate can be changed between steps without
recompiling, which is what `optax.inject_hyperparams` is for:

    opt_state = set_learning_rate(opt_state, 1e-4)   # the next update uses 1e-4
    get_learning_rate(opt_state)                     # the rate the last update used (for logging)

A schedule (a function of the step count) is evaluated at every step and its value written to the state;
setting it by hand is refused, since the next step would silently overwrite it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from purejax.optim.base import GradientTransformation, PyTree, Schedule, safe_increment, zero_count


class LearningRateState(NamedTuple):
    """A constant learning rate, read from here at every step: overwrite it to change the rate."""

    learning_rate: Float[Array, ""]


class ScheduleState(NamedTuple):
    """A scheduled learning rate: the step count it is evaluated at, and the value the last step used."""

    count: Int[Array, ""]
    learning_rate: Float[Array, ""]


def scale_by_learning_rate(learning_rate: ArrayLike | Schedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by `-learning_rate` (or `+learning_rate` with `flip_sign=False`).

    Arguments:
        learning_rate: a number, or a schedule `count -> rate` evaluated at the step count (0 on the first step).
        flip_sign: negate, so that `apply_updates` descends the gradient. Off inside optimizers that flip the
            sign themselves at the very end (adafactor).
    """
    sign = -1.0 if flip_sign else 1.0
    scheduled = callable(learning_rate)

    def init(params: PyTree) -> LearningRateState | ScheduleState:
        del params
        if scheduled:
            return ScheduleState(zero_count(), jnp.asarray(learning_rate(zero_count()), jnp.float32))
        return LearningRateState(jnp.asarray(learning_rate, jnp.float32))

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        if scheduled:
            rate = jnp.asarray(learning_rate(state.count), jnp.float32)
            state = ScheduleState(safe_increment(state.count), rate)
        else:
            rate = state.learning_rate
        step = sign * rate
        return jax.tree_util.tree_map(lambda g: step.astype(g.dtype) * g, updates), state

    return GradientTransformation(init, update)


def _is_rate_state(x: Any) -> bool:
    return isinstance(x, (LearningRateState, ScheduleState))


def get_learning_rate(opt_state: PyTree) -> Float[Array, ""] | None:
    """The rate the last update used: from the first `scale_by_learning_rate` state found in `opt_state`, or an
    optax `inject_hyperparams` state holding a `learning_rate`. None when there is neither."""
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: _is_rate_state(x) or _is_injected(x)):
        if _is_rate_state(node):
            return node.learning_rate
        if _is_injected(node):
            return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
    return None


def _is_injected(x: Any) -> bool:
    return hasattr(x, "hyperparams") and isinstance(x.hyperparams, dict) and "learning_rate" in x.hyperparams


def set_learning_rate(opt_state: PyTree, value: ArrayLike) -> PyTree:
    """`opt_state` with every constant learning rate set to `value` (a traced value is fine: no recompilation).

    Raises ValueError when the state holds no constant rate (a scheduled one would be overwritten at the next
    step: change the schedule instead)."""
    found = []

    def replace(node: Any) -> Any:
        if isinstance(node, LearningRateState):
            found.append(node)
            return LearningRateState(jnp.asarray(value, jnp.float32))
        return node

    new_state = jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_rate_state)
    if not found:
        raise ValueError(
            "set_learning_rate found no constant learning rate in the optimizer state; it works on the state of "
            "scale_by_learning_rate(<number>) (scheduled rates are recomputed every step: change the schedule)"
        )
    return new_state
