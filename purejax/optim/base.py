"""Gradient transformations: the `init`/`update` pair every optimizer is built from, `chain`, `apply_updates`.

A gradient transformation turns gradients into updates and carries a state from one step to the next:

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

This is optax's calling convention, so an optax transform can sit in a purejax `chain` and a purejax transform in
an `optax.chain`. As in optax, `update` may take extra keyword arguments, e.g. `value=loss` for
`optax.contrib.reduce_on_plateau`: `chain` hands each part the ones its `update` accepts (`extra_args_for`).

States are plain pytrees (they checkpoint as they are). Where purejax builds the structure it names the fields:
a NamedTuple per transform, and `chain` keys its parts by the names you give, so a checkpoint path reads
`adam.mu.blocks.attn.qkv.w` rather than optax's `0.mu.blocks.attn.qkv.w`.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from purejax import tree as tree_lib

PyTree = Any
Schedule = Callable[[Int[Array, ""]], ArrayLike]
"""A function from the step count (an int32 scalar, starting at 0) to a value, e.g. the learning rate."""


class GradientTransformation(NamedTuple):
    """A pure optimizer component: `init(params) -> state`, `update(updates, state, params) -> (updates, state)`.

    The same two fields, in the same order, as `optax.GradientTransformation`, so either library's `chain`
    accepts the other's transforms. An `update` that needs more than the gradients (the loss, for a
    plateau-based rate) takes it as a keyword argument: `update(updates, state, params, value=loss)`."""

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple[PyTree, PyTree]]


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none: a pytree with no leaves."""


def stateless(fn: Callable[[PyTree, PyTree], PyTree]) -> GradientTransformation:
    """A transformation from `fn(updates, params) -> updates` that keeps no state (clipping, weight decay)."""

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        return fn(updates, params), state

    return GradientTransformation(init, update)


def identity() -> GradientTransformation:
    """Passes updates through unchanged."""
    return stateless(lambda updates, params: updates)


def chain(*transforms: Any, **named: Any) -> GradientTransformation:
    """Apply transformations one after the other; the state is `{name: state}` in the same order.

        chain(clip=clip_by_global_norm(1.0), adam=scale_by_adam(), lr=scale_by_learning_rate(3e-4))

    Keyword arguments are named parts (their state is found under that name); positional ones, e.g. optax
    transforms you do not care to name, are named by their position ("0", "1", ...) and run first.

    `update(updates, state, params, **extra_args)` passes each part the extra keyword arguments it accepts, as
    `optax.chain` does: `chain(optax.contrib.reduce_on_plateau(), ...).update(g, s, p, value=loss)`.
    """
    parts = {str(i): t for i, t in enumerate(transforms)}
    for name, transform in named.items():
        if name in parts:
            raise ValueError(f"chain got two parts named {name!r}; positional parts are named by their index")
        parts[name] = transform
    for name, transform in parts.items():
        _check_part(name, transform)

    def init(params: PyTree) -> dict[str, PyTree]:
        return {name: t.init(params) for name, t in parts.items()}

    def update(
        updates: PyTree, state: dict[str, PyTree], params: PyTree = None, **extra_args: Any
    ) -> tuple[PyTree, dict[str, PyTree]]:
        if not isinstance(state, dict) or set(state) != set(parts):  # jax sorts dict keys: compare as sets
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"chain state has parts {got} but the chain has {list(parts)}; "
                "pass the state this chain's init returned (or a checkpoint of it)"
            )
        new_state = {}
        for name, t in parts.items():
            updates, new_state[name] = t.update(updates, state[name], params, **extra_args_for(t.update, extra_args))
        return updates, new_state

    return GradientTransformation(init, update)


def _check_part(name: str, transform: Any) -> None:
    if not name or "." in name:
        raise ValueError(f"chain part name {name!r} must be non-empty and contain no '.' (it becomes a path)")
    if not (callable(getattr(transform, "init", None)) and callable(getattr(transform, "update", None))):
        hint = " (did you forget to call it?)" if callable(transform) else ""
        raise TypeError(
            f"chain part {name!r} is a {type(transform).__name__}, not a gradient transformation with "
            f"init and update{hint}"
        )


def extra_args_for(update: Callable, extra_args: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `extra_args` that `update` accepts: all of them if it takes `**kwargs`, as optax's
    `GradientTransformationExtraArgs` do, else those it names (none for a plain `update(updates, state, params)`).

    `optax.chain` decides this by the transform's type (`with_extra_args_support`); reading the signature makes
    the same choice without importing optax, for a transform from any library. A callable whose signature
    cannot be read gets none."""
    if not extra_args:
        return {}
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(extra_args)
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in extra_args.items() if k in named}


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """`params + updates`, leaf by leaf, each result kept in its parameter's dtype (float32 master weights stay
    float32 even when an update arrives in bfloat16)."""
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(updates):
        raise tree_lib.TreeMismatchError(tree_lib.diff(updates, params, check_dtype=False).format("updates"))
    return jax.tree_util.tree_map(lambda p, u: jnp.asarray(p + u).astype(jnp.result_type(p)), params, updates)


def safe_increment(count: Int[Array, ""]) -> Int[Array, ""]:
    """`count + 1`, but staying at the dtype's maximum instead of wrapping around to a negative step."""
    top = jnp.iinfo(count.dtype).max
    return jnp.where(count < top, count + 1, top).astype(count.dtype)


def zero_count() -> Int[Array, ""]:
    """A fresh step counter: int32 zero, as optax keeps it."""
    return jnp.zeros((), jnp.int32)


def bias_correction(average: PyTree, decay: ArrayLike, count: Int[Array, ""]) -> PyTree:
    """`average / (1 - decay**count)`: undo the pull towards zero of an exponential average that started at 0.

    The factor is computed in float32 and only then cast to each leaf's dtype: in bfloat16 `decay**count` rounds
    to 1 early and the division would blow up."""
    correction = 1 - decay**count
    return jax.tree_util.tree_map(lambda m: m / correction.astype(m.dtype), average)
