"""Checks every layer makes at trace time (free under jit), so bad input fails at the call with a message that
names the layer, the argument and what was expected, instead of deep inside XLA."""

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


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
    """Raise if `x.shape[axis] != expected`, naming the argument, both shapes and where `expected` came from."""
    shape = np.shape(x)  # not x.shape: array-likes (numpy arrays, Python scalars) are accepted too
    if not shape or shape[axis] != expected:
        raise ValueError(f"{layer}: {arg} has shape {shape}, but its axis {axis} must be {expected} to match {source}")


def check_rate(layer: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{layer}: rate must be in [0, 1), got {rate}")
