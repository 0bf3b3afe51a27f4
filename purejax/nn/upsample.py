"""Resizing channels-last images by an integer scale factor or to a given size: nearest neighbour and bilinear,
as torch.nn.functional.interpolate computes them with `align_corners=False` (nn.Upsample's default).

No parameters, so no init: plain functions, like pooling. x is (*batch, *spatial, channels): NHWC images for
`bilinear`; `nearest` also takes 1-D signals and 3-D volumes (`spatial_dims=1` or `3`). Pass exactly one of
`scale_factor` (a positive int, or one per spatial axis: output size = input size * factor) or `size` (the
output's spatial size, larger or smaller than the input's). The factor must be an int so that the output size
and the source positions agree exactly (torch, given a fractional factor, places sources by the factor and
not by the sizes it rounds to).

Both resize one spatial axis at a time with source indices computed in numpy when the function is traced (the
sizes are static), so the compiled program is a few gathers and, for bilinear, a weighted sum. Along an axis of
`n_in` pixels resized to `n_out`, with scale = n_in / n_out computed in float32 as torch does:
- nearest: output pixel `i` copies input pixel `min(floor(i * scale), n_in - 1)`. This is torch's "nearest",
  not jax.image.resize's "nearest", which reads `floor((i + 0.5) * scale)` (torch's "nearest-exact"); the two
  differ when the ratio is not an integer. In exact arithmetic the rule is floor(i * n_in / n_out); torch's
  float32 scale rounds some products just below an integer (26 -> 22 pixels, i = 11, reads pixel 12 not 13),
  and this follows torch.
- bilinear: output pixel `i` sits at source position `s = max(scale * (i + 0.5) - 0.5, 0)` (half-pixel
  centres, clamped at 0) and is `(1 - t) * x[floor(s)] + t * x[min(floor(s) + 1, n_in - 1)]` with
  `t = s - floor(s)`. Along two axes this is the product of the two weights, as torch's bilinear. Computed in
  float32 whatever the input dtype, returned in the input dtype; no antialiasing when shrinking.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Shaped


def nearest(
    x: Shaped[ArrayLike, "... channels"],
    *,
    scale_factor: int | Sequence[int] | None = None,
    size: int | Sequence[int] | None = None,
    spatial_dims: int = 2,
) -> Shaped[Array, "... channels"]:
    """Each output pixel copies the input pixel `floor(i * n_in / n_out)` along each spatial axis (torch's
    mode="nearest"). Any dtype; the output has the input's."""
    x = jnp.asarray(x)
    for axis, (n_in, n_out) in _resized_axes("upsample.nearest", x, scale_factor, size, spatial_dims):
        x = jnp.take(x, _nearest_sources(n_in, n_out), axis=axis)
    return x


def bilinear(
    x: Float[ArrayLike, "*batch height width channels"],
    *,
    scale_factor: int | Sequence[int] | None = None,
    size: int | Sequence[int] | None = None,
) -> Float[Array, "*batch out_height out_width channels"]:
    """Linear interpolation between the two nearest input pixels along height, then along width, with
    half-pixel centres (torch's mode="bilinear", align_corners=False). In float32; returns the input dtype."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"upsample.bilinear: x must be a floating-point array, got dtype {x.dtype}")
    y = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    for axis, (n_in, n_out) in _resized_axes("upsample.bilinear", x, scale_factor, size, 2):
        below, above, weight_above = _linear_sources(n_in, n_out)
        weight_above = jnp.asarray(weight_above, y.dtype).reshape((n_out,) + (1,) * (y.ndim - 1 - axis))
        y = jnp.take(y, below, axis=axis) * (1 - weight_above) + jnp.take(y, above, axis=axis) * weight_above
    return y.astype(x.dtype)


def _nearest_sources(n_in: int, n_out: int) -> np.ndarray:
    """The input index each of `n_out` outputs copies: min(floor(i * scale), n_in - 1), scale in float32."""
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int32), n_in - 1)


def _linear_sources(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each of `n_out` outputs: the input index below its source position, the one above (clamped to the
    last pixel), and the weight of the one above, in float32 as torch."""
    scale = np.float32(n_in) / np.float32(n_out)
    source = np.maximum(scale * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), 0)
    below = np.floor(source).astype(np.int32)
    return below, np.minimum(below + 1, n_in - 1), (source - below).astype(np.float32)


def _resized_axes(
    layer: str,
    x: Array,
    scale_factor: int | Sequence[int] | None,
    size: int | Sequence[int] | None,
    spatial_dims: int,
) -> list[tuple[int, tuple[int, int]]]:
    """(axis, (input size, output size)) for each spatial axis of `x`, checking every argument."""
    if not _is_int(spatial_dims) or spatial_dims < 1:
        raise ValueError(f"{layer}: spatial_dims must be an int >= 1, got {spatial_dims!r}")
    if x.ndim < spatial_dims + 1:
        raise ValueError(
            f"{layer}: x must be (*batch, *spatial, channels) with {spatial_dims} spatial axes, "
            f"got shape {tuple(x.shape)}"
        )
    if (scale_factor is None) == (size is None):
        raise ValueError(f"{layer}: pass exactly one of scale_factor and size, got {scale_factor=} and {size=}")
    in_sizes = x.shape[x.ndim - 1 - spatial_dims : -1]
    if size is not None:
        out_sizes = _per_axis(layer, "size", size, spatial_dims)
    else:
        factors = _per_axis(layer, "scale_factor", scale_factor, spatial_dims)
        out_sizes = tuple(n * factor for n, factor in zip(in_sizes, factors))
    first = x.ndim - 1 - spatial_dims
    return [(first + i, (n_in, n_out)) for i, (n_in, n_out) in enumerate(zip(in_sizes, out_sizes))]


def _per_axis(layer: str, name: str, value: int | Sequence[int], spatial_dims: int) -> tuple[int, ...]:
    """`2` -> (2, 2) for two spatial axes; `(2, 3)` as it is; raise naming `name` unless positive ints."""
    values = (value,) * spatial_dims if _is_int(value) else tuple(value) if isinstance(value, Sequence) else ()
    if len(values) != spatial_dims or not all(_is_int(v) and v >= 1 for v in values):
        raise ValueError(
            f"{layer}: {name} must be a positive int or {spatial_dims} positive ints (one per spatial axis), "
            f"got {value!r}"
        )
    return tuple(int(v) for v in values)


def _is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
