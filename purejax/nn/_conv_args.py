"""Argument handling shared by the 1-, 2- and 3-D convolutions (conv, conv_transpose): the spatial rank, sizes
given as an int or one int per spatial axis, padding resolved to explicit (low, high) pairs per axis, and the
checks on channels and groups that both layers make.

The rank is never an argument of `apply`: it is read from the kernel, whose layout is (*kernel_size, in, out),
so a 3-D kernel (1 spatial axis) makes a 1-D convolution and a 5-D kernel a 3-D one. Padding is resolved to
explicit pairs before use, so every code path sees exactly the same padded input.
"""

from collections.abc import Sequence

import jax
from jaxtyping import Array

from purejax.nn._spatial import Padding

# The names of the spatial axes for each rank, as they appear in error messages and torch's docs.
SPATIAL_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}
# Channels-last layouts for lax.conv_general_dilated: (input, kernel, output).
DIMENSION_NUMBERS = {
    1: ("NWC", "WIO", "NWC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}
_PER_AXIS = {1: "(length,) tuple", 2: "(height, width) pair", 3: "(depth, height, width) triple"}
_EXPLICIT = {
    1: "((left, right),)",
    2: "((top, bottom), (left, right))",
    3: "((front, back), (top, bottom), (left, right))",
}


def check_spatial_dims(layer: str, spatial_dims: int) -> int:
    """`spatial_dims` itself, after checking it is 1, 2 or 3 (torch's Conv1d, Conv2d, Conv3d)."""
    if spatial_dims not in SPATIAL_AXES:
        raise ValueError(f"{layer}: spatial_dims must be 1, 2 or 3, got {spatial_dims!r}")
    return spatial_dims


def kernel_rank(layer: str, w: Array, layout: str) -> int:
    """The number of spatial axes of the kernel `w`; raise naming params['w'] if it has not 1, 2 or 3."""
    rank = w.ndim - 2
    if rank not in SPATIAL_AXES:
        raise ValueError(f"{layer}: params['w'] must be {layout} with 1, 2 or 3 spatial axes, got shape {w.shape}")
    return rank


def check_input_rank(layer: str, x: Array, rank: int) -> None:
    """Raise if `x` has fewer axes than (*batch, *spatial, in_channels) needs for a `rank`-D kernel."""
    if x.ndim < rank + 1:
        axes = ", ".join(SPATIAL_AXES[rank])
        raise ValueError(f"{layer}: x must be (*batch, {axes}, in_channels), got shape {x.shape}")


def check_channels(layer: str, in_channels: int, out_channels: int, groups: int) -> None:
    """Raise unless both channel counts are positive and `groups` divides both (the init-time check)."""
    if in_channels <= 0 or out_channels <= 0:
        raise ValueError(f"{layer}: in_channels and out_channels must be positive, got {in_channels}, {out_channels}")
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise ValueError(
            f"{layer}: groups={groups} must be >= 1 and divide both in_channels={in_channels} and "
            f"out_channels={out_channels} (depthwise: groups=in_channels, out_channels a multiple of it)"
        )


def to_tuple(layer: str, name: str, value: int | Sequence[int], rank: int, minimum: int = 1) -> tuple[int, ...]:
    """`3` -> (3,) * rank; `(3, 5)` -> (3, 5) when rank is 2; raise naming `name` if it is not one int or `rank`
    ints, each >= minimum."""
    values = (value,) * rank if isinstance(value, int) else tuple(value) if isinstance(value, Sequence) else ()
    if len(values) != rank or not all(isinstance(v, int) and v >= minimum for v in values):
        raise ValueError(f"{layer}: {name} must be an int or a {_PER_AXIS[rank]} of ints >= {minimum}, got {value}")
    return values


def resolve_padding(
    layer: str,
    padding: Padding,
    in_sizes: Sequence[int],
    window: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
) -> tuple[tuple[int, int], ...]:
    """Explicit (low, high) pads per spatial axis for `padding` on an input of spatial size `in_sizes`.

    "SAME" follows XLA/TensorFlow: output size ceil(in / stride), and when an axis's total pad is odd the extra
    one goes at the end (bottom/right). torch pads symmetrically instead (3x3 stride 2 with padding=1), which is
    `padding=1` here; the two differ for stride 2 on even sizes.
    """
    rank = len(in_sizes)
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"{layer}: padding must be 'SAME', 'VALID', an int or {_EXPLICIT[rank]}, got {padding!r}")
        effective = tuple((w - 1) * d + 1 for w, d in zip(window, dilation))
        pads = jax.lax.padtype_to_pads(in_sizes, effective, stride, padding.upper())
        return tuple((int(low), int(high)) for low, high in pads)
    if isinstance(padding, int):
        if padding < 0:
            raise ValueError(f"{layer}: padding must be >= 0, got {padding}")
        return ((padding, padding),) * rank
    if not (isinstance(padding, Sequence) and len(padding) == rank and all(_is_pad_pair(p) for p in padding)):
        raise ValueError(f"{layer}: explicit padding must be {_EXPLICIT[rank]} of ints >= 0, got {padding!r}")
    return tuple((low, high) for low, high in padding)


def _is_pad_pair(pair: object) -> bool:
    return isinstance(pair, Sequence) and len(pair) == 2 and all(isinstance(v, int) and v >= 0 for v in pair)
