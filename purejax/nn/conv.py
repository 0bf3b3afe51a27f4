"""1-, 2- and 3-D convolution, channels last: stride, padding, dilation and feature groups.

params: {"w": (*kernel_size, in_channels // groups, out_channels), "b": (out_channels,)}; "b" is absent when
bias=False. The number of spatial axes is read from the kernel: (kw, in, out) convolves (*batch, length,
channels) sequences, (kh, kw, in, out) (HWIO) NHWC images, (kd, kh, kw, in, out) NDHWC volumes. torch stores
the kernel as (out, in // groups, *kernel_size); `w_torch.permute(2, 3, 1, 0)` gives this layout in 2-D,
`permute(2, 1, 0)` in 1-D and `permute(2, 3, 4, 1, 0)` in 3-D.

Groups split the input channels into `groups` blocks, each convolved with its own out_channels // groups
filters (XLA's feature_group_count, torch's `groups`). groups == in_channels is a depthwise convolution;
out_channels = k * in_channels adds a channel multiplier k, and output channel c * k + j reads input channel c.

Depthwise fast path. On CPU, XLA lowers a grouped convolution with one channel per group far more slowly than
the same arithmetic written out: pad once, then for each kernel tap take the strided slice of the padded input
that the tap sees and multiply it by that tap's per-channel weights, and sum the products over the taps.
`depthwise_impl="shifts"` does that, `"xla"` calls `lax.conv_general_dilated`, and `"auto"` picks
by backend from measurements (bench/conv.py, docs/benchmarks.md, 2-D): shifts on CPU, XLA elsewhere (cuDNN has
dedicated depthwise kernels; no GPU measurement argues otherwise). Both give the same result and gradients to
float rounding (tests/purejax/nn/test_conv.py, test_conv_nd.py).
"""

import itertools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn import initializers
from purejax.nn._check import check_dim, check_keys
from purejax.nn._conv_args import (
    DIMENSION_NUMBERS,
    check_channels,
    check_input_rank,
    check_spatial_dims,
    kernel_rank,
    resolve_padding,
    to_tuple,
)
from purejax.nn._spatial import Padding, out_size

Params = dict[str, Array]
DepthwiseImpl = Literal["auto", "xla", "shifts"]

# Backends on which "auto" uses the shifted-slices depthwise path (measured: bench/conv.py).
SHIFTS_BACKENDS = ("cpu",)
KERNEL_LAYOUT = "(*kernel_size, in_channels // groups, out_channels)"


def init(
    key: PRNGKeyArray,
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int],
    *,
    spatial_dims: int = 2,
    groups: int = 1,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.he_normal(),
    dtype: Any = jnp.float32,
) -> Params:
    """Kernel from `w_init`, bias zeros.

    `spatial_dims` (1, 2 or 3) is the number of spatial axes: `kernel_size` is an int or that many ints, and
    the kernel is (*kernel_size, in_channels // groups, out_channels). The default is 2, images.

    The default is He normal (variance 2 / fan_in, fan_in = prod(kernel_size) * in_channels // groups) because
    convolutions are almost always followed by a ReLU-family activation (He et al. 2015). torchvision's
    MobileNetV2 uses He with fan_out: `initializers.variance_scaling(2.0, "fan_out", "normal")`.
    """
    kernel_size = to_tuple("conv.init", "kernel_size", kernel_size, check_spatial_dims("conv.init", spatial_dims))
    check_channels("conv.init", in_channels, out_channels, groups)
    params = {"w": w_init(key, (*kernel_size, in_channels // groups, out_channels), dtype)}
    if bias:
        params["b"] = jnp.zeros((out_channels,), dtype)
    return params


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch_and_spatial in_channels"],
    *,
    stride: int | Sequence[int] = 1,
    padding: Padding = "SAME",
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    depthwise_impl: DepthwiseImpl = "auto",
) -> Float[Array, "*batch_and_out_spatial out_channels"]:
    """Convolve `x` (*batch, *spatial, in_channels) with `params["w"]` (*kernel_size, in_channels // groups,
    out_channels); `x` has as many spatial axes as the kernel and any number of leading batch axes, including
    none. In 2-D that is NHWC images and an HWIO kernel.

    Arguments:
        stride, dilation: an int or one int per spatial axis ((height, width) in 2-D). Dilation spaces the
            kernel taps (atrous conv).
        padding: "SAME" (output size ceil(in / stride), extra pad at the end as XLA and TensorFlow), "VALID"
            (none), an int p (p on every side, as torch's `padding=p`), or one (low, high) pair per spatial
            axis: ((top, bottom), (left, right)) in 2-D.
        groups: feature groups; must equal in_channels // params["w"].shape[-2]. It is an argument rather than
            read from the shapes so that an input with the wrong channel count fails instead of silently
            becoming a different grouping.
        depthwise_impl: how a depthwise convolution (groups == in_channels) is computed; see the module
            docstring. "auto" and "xla" accept any grouping; "shifts" on a non-depthwise one is an error.
    """
    x = jnp.asarray(x)
    depthwise = _check(params, x, groups, depthwise_impl)
    w = params["w"]
    rank = w.ndim - 2
    kernel_size = w.shape[:rank]
    stride = to_tuple("conv", "stride", stride, rank)
    dilation = to_tuple("conv", "dilation", dilation, rank)
    in_sizes = x.shape[-rank - 1 : -1]
    pads = resolve_padding("conv", padding, in_sizes, kernel_size, stride, dilation)
    out_sizes = tuple(out_size(n, p, k, s, d) for n, p, k, s, d in zip(in_sizes, pads, kernel_size, stride, dilation))
    if min(out_sizes) < 1:
        raise ValueError(
            f"conv: a {'x'.join(map(str, kernel_size))} kernel with dilation {dilation} does not fit the "
            f"{in_sizes} input padded by {pads}"
        )

    batch_shape = x.shape[: -rank - 1]
    flat = x.reshape((-1, *x.shape[-rank - 1 :]))  # lax convolutions take exactly one batch axis
    dtype = jnp.result_type(flat, w)
    flat, w = flat.astype(dtype), w.astype(dtype)
    auto_shifts = depthwise_impl == "auto" and jax.default_backend() in SHIFTS_BACKENDS
    if depthwise and (depthwise_impl == "shifts" or auto_shifts):
        y = _depthwise_shifts(flat, w, stride, pads, dilation, out_sizes)
    else:
        y = jax.lax.conv_general_dilated(
            flat,
            w,
            stride,
            pads,
            rhs_dilation=dilation,
            feature_group_count=groups,
            dimension_numbers=DIMENSION_NUMBERS[rank],
        )
    y = y.reshape((*batch_shape, *y.shape[1:]))
    if "b" in params:
        y = y + params["b"].astype(dtype)
    return y


def _check(params: Any, x: Array, groups: int, depthwise_impl: str) -> bool:
    """Raise naming what is wrong with the params, the input or the grouping; return whether the convolution
    is depthwise (one input channel per group, groups == in_channels)."""
    check_keys(params, "conv", required=("w",), optional=("b",))
    w = params["w"]
    check_input_rank("conv", x, kernel_rank("conv", w, KERNEL_LAYOUT))
    in_per_group, out_channels = w.shape[-2:]
    if groups < 1 or out_channels % groups:
        raise ValueError(
            f"conv: groups={groups} must be >= 1 and divide out_channels={out_channels} of params['w'] {w.shape}"
        )
    check_dim("conv", "x", x, -1, in_per_group * groups, f"params['w'] of shape {w.shape} with groups={groups}")
    if "b" in params:
        check_dim("conv", "params['b']", params["b"], -1, out_channels, f"params['w'] of shape {w.shape}")
    if depthwise_impl not in ("auto", "xla", "shifts"):
        raise ValueError(f"conv: depthwise_impl must be 'auto', 'xla' or 'shifts', got {depthwise_impl!r}")
    depthwise = in_per_group == 1 and groups == x.shape[-1]
    if depthwise_impl == "shifts" and not depthwise:
        raise ValueError(
            f"conv: depthwise_impl='shifts' needs a depthwise convolution (groups == in_channels == {x.shape[-1]}), "
            f"got groups={groups}; use 'auto' or 'xla'"
        )
    return depthwise


def _depthwise_shifts(
    x: Float[Array, "batch *spatial channels"],
    w: Float[Array, "*kernel_size 1 out_channels"],
    stride: tuple[int, ...],
    pads: tuple[tuple[int, int], ...],
    dilation: tuple[int, ...],
    out_sizes: tuple[int, ...],
) -> Float[Array, "batch *out_spatial out_channels"]:
    """Depthwise convolution as a sum over kernel taps t of the strided slice of the padded input that the tap
    sees times the tap's weights; in 2-D, padded_x[:, i*dh + sh*r, j*dw + sw*c, :] * w[i, j] over taps (i, j).

    Accumulates in float32 (or wider) and returns the input dtype, as XLA's convolution does."""
    n, channels = x.shape[0], x.shape[-1]
    kernel_size, out_channels = w.shape[:-2], w.shape[-1]
    multiplier = out_channels // channels
    acc = jnp.promote_types(x.dtype, jnp.float32)
    padded = jnp.pad(x.astype(acc), ((0, 0), *pads, (0, 0)))
    taps = w.astype(acc).reshape(*kernel_size, channels, multiplier)  # out channel c * multiplier + j -> [c, j]
    y = None
    for tap in itertools.product(*(range(k) for k in kernel_size)):  # in 2-D: i outer, j inner
        start = (0, *(t * d for t, d in zip(tap, dilation)), 0)
        ends = (t * d + (o - 1) * s + 1 for t, d, o, s in zip(tap, dilation, out_sizes, stride))
        patch = jax.lax.slice(padded, start, (n, *ends, channels), (1, *stride, 1))
        term = patch[..., None] * taps[tap] if multiplier > 1 else patch * taps[tap][:, 0]
        y = term if y is None else y + term
    return y.reshape(n, *out_sizes, out_channels).astype(x.dtype)
