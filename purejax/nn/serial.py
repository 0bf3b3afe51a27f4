"""A plain chain of layers, each fed the previous one's output: stax's `serial`, with named params.

    model = [
        serial.layer("conv", lambda key: conv.init(key, 1, 8, (3, 3)), lambda p, x: conv.apply(p, x, padding="SAME")),
        serial.function(jax.nn.relu),
        serial.function(pooling.global_avg_pool),
        serial.layer("head", lambda key: linear.init(key, 8, 10), linear.apply),
    ]
    params = serial.init(key, model)          # {"conv": {"w", "b"}, "head": {"w", "b"}}
    logits = serial.apply(params, x, model)   # head(pool(relu(conv(x))))

Why names. A layer's params live under its own name, and its init key is `fold_in_name(key, name)`
(`purejax.random.named_keys`), so inserting a function or a layer elsewhere in the chain changes neither
the paths of the other layers' params (a checkpoint still loads) nor their initial values.

Randomness. A step that draws (dropout) says so with `random=True` and is then called with a key of its
own, `fold_in(key, i)` for step i, or None when `apply` gets no key (evaluation):

    serial.function(lambda x, key: dropout.apply(x, rate=0.1, key=key), random=True)

What it is not for: a model with branches, a residual connection or state (BatchNorm's statistics) stays
plain functions calling `init`/`apply` pairs, as models/gpt.py does. The chain is a list of steps, not an
object that holds params: `init` and `apply` are pure functions of it.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from purejax import random as prandom

Params = dict[str, Any]


class Step(NamedTuple):
    """One step of a chain: `name` (None for a function without params), its `init(key) -> params` (None for a
    function), and its `apply(params, x, key) -> y`, the form every step is called in."""

    name: str | None
    init: Callable[[PRNGKeyArray], Params] | None
    apply: Callable[[Params | None, Any, PRNGKeyArray | None], Any]


def layer(
    name: str, init: Callable[[PRNGKeyArray], Params], apply: Callable[..., Any], *, random: bool = False
) -> Step:
    """A step with params: `init(key) -> params`, and `apply(params, x)` (with `random`: `apply(params, x, key)`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"serial.layer: name must be a non-empty str (the key of its params), got {name!r}")
    if random:
        return Step(name, init, apply)
    return Step(name, init, lambda params, x, key: apply(params, x))


def function(fn: Callable[..., Any], *, random: bool = False) -> Step:
    """A step without params: `fn(x)` (with `random`: `fn(x, key)`, the key None in evaluation)."""
    if random:
        return Step(None, None, lambda params, x, key: fn(x, key))
    return Step(None, None, lambda params, x, key: fn(x))


def init(key: PRNGKeyArray, steps: Sequence[Step]) -> Params:
    """`{name: step.init(fold_in_name(key, name))}` for each step with params."""
    names = _names(steps)
    keys = prandom.named_keys(key, *names)
    return {step.name: step.init(keys[step.name]) for step in steps if step.name is not None}


def apply(params: Params, x: ArrayLike, steps: Sequence[Step], *, key: PRNGKeyArray | None = None) -> Array:
    """The steps in order, each on the previous one's output; step i's key is `fold_in(key, i)` (None without a
    key). The params must be those `init` made for these steps: a missing or extra name is an error."""
    names = _names(steps)
    if not isinstance(params, dict) or set(params) != set(names):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"serial.apply: params hold {got}, but the steps' layers are {sorted(names)}")
    for i, step in enumerate(steps):
        step_key = None if key is None else jax.random.fold_in(key, i)
        x = step.apply(None if step.name is None else params[step.name], x, step_key)
    return x


def _names(steps: Sequence[Step]) -> list[str]:
    if not all(isinstance(step, Step) for step in steps):
        bad = next(step for step in steps if not isinstance(step, Step))
        raise TypeError(f"serial: every one of the steps must come from serial.layer or serial.function, got {bad!r}")
    names = [step.name for step in steps if step.name is not None]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"serial: the layer names {repeated} are used twice; each layer's params need their own")
    return names
