"""Shared argument handling for the 2-D spatial layers (conv, pooling): sizes given as an int or a
(height, width) pair, and padding given as "SAME", "VALID", an int, or explicit ((top, bottom), (left, right)).

Padding is always resolved to explicit pairs before use, so every code path (XLA's convolution, the
shifted-slices depthwise path, the pooling windows) sees exactly the same padded image.
"""

from collections.abc import Sequence

import jax

Pair = tuple[int, int]
Padding = str | int | Sequence[Sequence[int]]


def to_pair(layer: str, name: str, value: int | Sequence[int], minimum: int = 1) -> Pair:
    """`3` -> (3, 3); `(3, 5)` -> (3, 5); raise naming `name` if it is not one or two ints >= minimum."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= minimum for v in pair):
        raise ValueError(f"{layer}: {name} must be an int or a (height, width) pair of ints >= {minimum}, got {value}")
    return pair  # type: ignore[return-value]


def resolve_padding(
    layer: str, padding: Padding, in_hw: Pair, window: Pair, stride: Pair, dilation: Pair = (1, 1)
) -> tuple[Pair, Pair]:
    """Explicit ((top, bottom), (left, right)) pads for `padding` on an image of size `in_hw`.

    "SAME" follows XLA/TensorFlow: output size ceil(in / stride), and when the total pad is odd the extra row
    or column goes at the bottom/right. torch pads symmetrically instead (3x3 stride 2 with padding=1), which
    is `padding=1` here; the two differ for stride 2 on even-sized inputs.
    """
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(
                f"{layer}: padding must be 'SAME', 'VALID', an int or ((top, bottom), (left, right)), got {padding!r}"
            )
        effective = tuple((w - 1) * d + 1 for w, d in zip(window, dilation))
        pads = jax.lax.padtype_to_pads(in_hw, effective, stride, padding.upper())
        return tuple((int(lo), int(hi)) for lo, hi in pads)  # type: ignore[return-value]
    if isinstance(padding, int):
        if padding < 0:
            raise ValueError(f"{layer}: padding must be >= 0, got {padding}")
        return (padding, padding), (padding, padding)
    pairs = tuple(tuple(p) for p in padding)
    if len(pairs) != 2 or not all(len(p) == 2 and all(isinstance(v, int) and v >= 0 for v in p) for p in pairs):
        raise ValueError(
            f"{layer}: explicit padding must be ((top, bottom), (left, right)) of ints >= 0, got {padding!r}"
        )
    return pairs  # type: ignore[return-value]


def out_size(in_size: int, pads: Pair, window: int, stride: int, dilation: int = 1) -> int:
    """Output length along one axis: floor((in + pads - effective window) / stride) + 1."""
    return (in_size + pads[0] + pads[1] - (window - 1) * dilation - 1) // stride + 1
