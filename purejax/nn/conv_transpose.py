"""1-, 2- and 3-D transposed convolution, channels last, with torch's ConvTranspose{1,2,3}d semantics: stride,
padding, output_padding, dilation and groups.

The definition (torch's): each input position p scatters its channels, through the kernel, onto the output. With
in_per_group = in_channels // groups and out_per_group = out_channels // groups, for every kernel tap t,

    y[..., p * stride - padding + t * dilation, g * out_per_group + o]
        += sum over i < in_per_group of x[..., p, g * in_per_group + i] * w[t, g * in_per_group + i, o]

per spatial axis, so the output is (in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1
long. `padding` crops that many positions from each end of the full scatter; `output_padding` adds positions at
the end only, because a strided convolution maps several input sizes to one output size and this picks which:
it must be smaller than the stride or the dilation (torch's rule). With the same stride, padding and dilation,
this is the gradient of `conv.apply` with respect to its input, the upsampling half of an encoder-decoder.

params: {"w": (*kernel_size, in_channels, out_channels // groups), "b": (out_channels,)}; "b" is absent when
bias=False. torch stores the weight as (in_channels, out_channels // groups, *kernel_size): the same two channel
axes in the same order, moved after the kernel axes, so `w_torch.permute(2, 3, 0, 1)` gives this layout in 2-D,
`permute(2, 0, 1)` in 1-D and `permute(2, 3, 4, 0, 1)` in 3-D. The spatial rank is read from the kernel.

How it is computed: as one forward convolution (`lax.conv_general_dilated`), the standard identity: put
stride - 1 zeros between input positions (lhs_dilation), pad each end of every axis by dilation * (k - 1) -
padding (plus output_padding at the end; a negative pad crops), and convolve with stride 1 and the kernel
flipped along every spatial axis, its in and out axes swapped within each group.
"""

from collections.abc import Sequence
from typing import Any

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
    to_tuple,
)

Params = dict[str, Array]
KERNEL_LAYOUT = "(*kernel_size, in_channels, out_channels // groups)"


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
    """Kernel (*kernel_size, in_channels, out_channels // groups) from `w_init`, bias zeros.

    `spatial_dims` (1, 2 or 3) is the number of spatial axes: `kernel_size` is an int or that many ints. The
    default initializer is conv's, He normal over the kernel's (..., in, out) shape, so with fan_in =
    prod(kernel_size) * in_channels.
    """
    kernel_size = to_tuple(
        "conv_transpose.init", "kernel_size", kernel_size, check_spatial_dims("conv_transpose.init", spatial_dims)
    )
    check_channels("conv_transpose.init", in_channels, out_channels, groups)
    params = {"w": w_init(key, (*kernel_size, in_channels, out_channels // groups), dtype)}
    if bias:
        params["b"] = jnp.zeros((out_channels,), dtype)
    return params


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch_and_spatial in_channels"],
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Float[Array, "*batch_and_out_spatial out_channels"]:
    """Transposed convolution of `x` (*batch, *spatial, in_channels) with `params["w"]`; `x` has as many spatial
    axes as the kernel and any number of leading batch axes, including none.

    Arguments (each an int or one int per spatial axis, as torch's):
        stride: the spacing of the input positions on the output (the upsampling factor).
        padding: positions cropped from each end of every spatial axis of the full output.
        output_padding: positions added at the end of every spatial axis; smaller than stride or dilation.
        dilation: the spacing of the kernel taps.
        groups: feature groups; in_channels must be a multiple of it, and out_channels is
            groups * params["w"].shape[-1].
    """
    x = jnp.asarray(x)
    _check(params, x, groups)
    w = params["w"]
    rank = w.ndim - 2
    kernel_size = w.shape[:rank]
    stride = to_tuple("conv_transpose", "stride", stride, rank)
    padding = to_tuple("conv_transpose", "padding", padding, rank, minimum=0)
    output_padding = to_tuple("conv_transpose", "output_padding", output_padding, rank, minimum=0)
    dilation = to_tuple("conv_transpose", "dilation", dilation, rank)
    if any(o >= max(s, d) for o, s, d in zip(output_padding, stride, dilation)):
        raise ValueError(
            f"conv_transpose: output_padding {output_padding} must be smaller than either stride {stride} or "
            f"dilation {dilation} on every axis (torch's rule)"
        )
    in_sizes = x.shape[-rank - 1 : -1]
    zipped = zip(in_sizes, kernel_size, stride, padding, output_padding, dilation)
    out_sizes = tuple((n - 1) * s - 2 * p + d * (k - 1) + o + 1 for n, k, s, p, o, d in zipped)
    if min(out_sizes) < 1:
        raise ValueError(
            f"conv_transpose: padding {padding} crops the whole output of a {'x'.join(map(str, kernel_size))} "
            f"kernel on the {in_sizes} input (output size {out_sizes})"
        )
    pads = tuple(
        (d * (k - 1) - p, d * (k - 1) - p + o) for k, p, o, d in zip(kernel_size, padding, output_padding, dilation)
    )

    batch_shape = x.shape[: -rank - 1]
    flat = x.reshape((-1, *x.shape[-rank - 1 :]))  # lax convolutions take exactly one batch axis
    dtype = jnp.result_type(flat, w)
    y = jax.lax.conv_general_dilated(
        flat.astype(dtype),
        _forward_kernel(w.astype(dtype), groups),
        (1,) * rank,
        pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        feature_group_count=groups,
        dimension_numbers=DIMENSION_NUMBERS[rank],
    )
    y = y.reshape((*batch_shape, *y.shape[1:]))
    if "b" in params:
        y = y + params["b"].astype(dtype)
    return y


def _forward_kernel(
    w: Float[Array, "*kernel_size in_channels out_per_group"], groups: int
) -> Float[Array, "*kernel_size in_per_group out_channels"]:
    """The kernel of the forward convolution that computes the transposed one: flipped along every spatial axis,
    and per group g, the (in_per_group, out_per_group) block of w becomes output channels g * out_per_group + o."""
    *kernel_size, in_channels, out_per_group = w.shape
    flipped = jnp.flip(w, axis=tuple(range(len(kernel_size))))
    blocks = flipped.reshape(*kernel_size, groups, in_channels // groups, out_per_group)
    return jnp.swapaxes(blocks, -3, -2).reshape(*kernel_size, in_channels // groups, groups * out_per_group)


def _check(params: Any, x: Array, groups: int) -> None:
    """Raise naming what is wrong with the params, the input or the grouping."""
    check_keys(params, "conv_transpose", required=("w",), optional=("b",))
    w = params["w"]
    check_input_rank("conv_transpose", x, kernel_rank("conv_transpose", w, KERNEL_LAYOUT))
    in_channels, out_per_group = w.shape[-2:]
    if groups < 1 or in_channels % groups:
        raise ValueError(
            f"conv_transpose: groups={groups} must be >= 1 and divide in_channels={in_channels} of params['w'] "
            f"{w.shape} {KERNEL_LAYOUT}"
        )
    check_dim("conv_transpose", "x", x, -1, in_channels, f"params['w'] of shape {w.shape} {KERNEL_LAYOUT}")
    if "b" in params:
        source = f"params['w'] of shape {w.shape} with groups={groups} (out_channels = groups * {out_per_group})"
        check_dim("conv_transpose", "params['b']", params["b"], -1, groups * out_per_group, source)
