"""Pooling over NHWC images: average and max over sliding windows, and the global average over H and W.

No parameters, so no init: these are plain functions like the activations. The window size is positional (a
size, like a layer's sizes in init); stride and padding are keyword-only options, as in `conv.apply`.

Padding for `avg_pool` does not count: a window that hangs over the border averages only the real pixels it
covers (TensorFlow's SAME average pooling, torch's `count_include_pad=False`), so border outputs are not pulled
towards zero. Pass `count_include_pad=True` for torch's and Flax's default, which divides by the full window.
`max_pool` pads with -inf, so padding never wins.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from purejax.nn._spatial import Padding, resolve_padding, to_pair


def _window_args(
    layer: str, x: Array, window: int | Sequence[int], stride: int | Sequence[int] | None, padding: Padding
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """reduce_window's dimensions, strides and pads for a 2-D window over axes -3, -2 of `x`."""
    if x.ndim < 3:
        raise ValueError(f"{layer}: x must be (*batch, height, width, channels), got shape {tuple(x.shape)}")
    window = to_pair(layer, "window", window)
    stride = window if stride is None else to_pair(layer, "stride", stride)
    pads = resolve_padding(layer, padding, x.shape[-3:-1], window, stride)
    if any(p[0] >= window[i] or p[1] >= window[i] for i, p in enumerate(pads)):
        raise ValueError(f"{layer}: padding {pads} must be smaller than the window {window} on each side")
    lead = x.ndim - 3
    dims = (1,) * lead + (*window, 1)
    strides = (1,) * lead + (*stride, 1)
    full_pads = ((0, 0),) * lead + (*pads, (0, 0))
    if any(n + p[0] + p[1] < k for n, p, k in zip(x.shape, full_pads, dims)):
        raise ValueError(f"{layer}: a {window} window does not fit the image {x.shape[-3:-1]} padded by {pads}")
    return dims, strides, full_pads


def avg_pool(
    x: Float[ArrayLike, "*batch height width channels"],
    window: int | Sequence[int],
    *,
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    count_include_pad: bool = False,
) -> Float[Array, "*batch out_height out_width channels"]:
    """Mean over each `window` (an int or (height, width)), moved by `stride` (default: the window, so
    windows do not overlap). Padding as in `conv.apply`. Sums in float32, returns the input dtype."""
    x = jnp.asarray(x)
    dims, strides, pads = _window_args("avg_pool", x, window, stride, padding)
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    total = jax.lax.reduce_window(x32, 0.0, jax.lax.add, dims, strides, pads)
    if count_include_pad:
        count = float(dims[-3] * dims[-2])
    else:  # how many real pixels each window covers: the same window sum over an image of ones
        ones = jnp.ones(x.shape[-3:-1] + (1,), x32.dtype)
        count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, dims[-3:], strides[-3:], pads[-3:])
    return (total / count).astype(x.dtype)


def max_pool(
    x: Float[ArrayLike, "*batch height width channels"],
    window: int | Sequence[int],
    *,
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> Float[Array, "*batch out_height out_width channels"]:
    """Maximum over each `window`, moved by `stride` (default: the window). Padded positions are -inf."""
    x = jnp.asarray(x)
    dims, strides, pads = _window_args("max_pool", x, window, stride, padding)
    return jax.lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), jax.lax.max, dims, strides, pads)


def global_avg_pool(x: Float[ArrayLike, "*batch height width channels"]) -> Float[Array, "*batch channels"]:
    """Mean over height and width (the last step of MobileNet and ResNet before the classifier), in float32."""
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"global_avg_pool: x must be (*batch, height, width, channels), got shape {tuple(x.shape)}")
    return jnp.mean(x.astype(jnp.promote_types(x.dtype, jnp.float32)), axis=(-3, -2)).astype(x.dtype)
