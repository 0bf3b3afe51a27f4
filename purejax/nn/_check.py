"""Checks every layer makes at trace time (free under jit), so bad input fails at the call with a message that
names the layer, the argument and what was expected, instead of deep inside XLA.

The shape predicates are chex's (`chex.assert_axis_dimension`, `assert_shape` with `None` wildcards,
`assert_equal_shape_prefix` over a whole tree): tested, rank-safe (an axis the array does not have fails
cleanly) and working on tracers. The words are purejax's: chex's own message names neither the layer nor the
argument, so `_require` turns its AssertionError into purejax's ValueError with purejax's message, keeping
chex's text as the cause. `chex.disable_asserts()` turns these checks off along with chex's own.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import chex
import numpy as np

from purejax import tree as tree_lib


def _require(assertion: Callable[[], None], message: Callable[[], str]) -> None:
    """Run the chex `assertion`; if it fails, raise ValueError(message()) (built only then) from chex's error."""
    try:
        assertion()
    except AssertionError as e:
        raise ValueError(message()) from e


def check_keys(params: Any, layer: str, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    """Raise if `params` is not a dict holding exactly the `required` keys (plus any of `optional`)."""
    required, optional = tuple(required), tuple(optional)
    if not isinstance(params, Mapping):
        raise TypeError(f"{layer}: params must be a dict with keys {list(required)}, got {type(params).__name__}")
    missing = [k for k in required if k not in params]
    unexpected = [k for k in params if k not in required and k not in optional]
    if missing or unexpected:
        raise KeyError(
            f"{layer}: params have missing keys {missing} and unexpected keys {unexpected}; "
            f"expected {list(required)}" + (f" and optionally {list(optional)}" if optional else "")
        )


def check_dim(layer: str, arg: str, x: Any, axis: int, expected: int, source: str) -> None:
    """Raise if `x.shape[axis] != expected` (or `x` has no such axis), naming the argument, both shapes and
    where `expected` came from. `x` may be any array-like: numpy arrays and Python scalars are accepted too."""
    _require(
        lambda: chex.assert_axis_dimension(_shaped(x), axis, expected),
        lambda: f"{layer}: {arg} has shape {np.shape(x)}, but its axis {axis} must be {expected} to match {source}",
    )


def check_shape(layer: str, arg: str, x: Any, expected: Sequence[int | str], source: str) -> None:
    """Raise if the shape of `x` does not match `expected`, an int per axis that must have that size or a name
    for an axis of any size: `check_shape("mobilenet", "x", x, ("batch", "height", "width", 3), "config")`."""
    _require(
        lambda: chex.assert_shape(_shaped(x), tuple(None if isinstance(d, str) else d for d in expected)),
        lambda: f"{layer}: {arg} has shape {np.shape(x)}, expected {_pattern(expected)} to match {source}",
    )


def check_same_leading_axis(where: str, tree: Any, name: str, hint: str) -> int:
    """The size of the leading axis that every array leaf of `tree` must share (a stacked layer axis); raise
    listing each leaf's path and shape when they do not, or when `tree` holds no arrays."""
    flat = tree_lib.flatten(tree)
    if not flat:
        raise ValueError(f"{where}: {name} has no arrays, so it has no layer axis")
    shapes = [np.shape(leaf) for leaf in flat.values()]
    _require(
        lambda: chex.assert_equal_shape_prefix([_shaped(leaf) for leaf in flat.values()], 1),
        lambda: (
            f"{where}: every leaf of {name} needs the same leading layer axis, got "
            + ", ".join(f"{p}: {tree_lib.describe(leaf)}" for p, leaf in flat.items())
            + f"; {hint}"
        ),
    )
    if not shapes[0]:
        raise ValueError(f"{where}: {name} holds only scalars, so it has no layer axis; {hint}")
    return shapes[0][0]


def check_rate(layer: str, rate: float) -> None:
    """Raise if a dropout `rate` is outside [0, 1) (NaN included): 1 would drop everything and divide by 0."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{layer}: rate must be in [0, 1), got {rate}")


def _shaped(x: Any) -> np.ndarray:
    """A stand-in of x's shape that holds no data (a broadcast view, whatever the size): what chex inspects,
    for any array-like (a tracer, a numpy array, a Python scalar or list)."""
    return np.broadcast_to(np.False_, np.shape(x))


def _pattern(shape: Sequence[int | str]) -> str:
    """("batch", 3) -> "(batch, 3)"; (4,) -> "(4,)", as Python writes a shape."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
