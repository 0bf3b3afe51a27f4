"""2-D convolution over NHWC images with HWIO kernels: stride, padding, dilation and feature groups.

params: {"w": (kh, kw, in_channels // groups, out_channels), "b": (out_channels,)}; "b" is absent when
bias=False. torch stores the kernel as OIHW; `w_torch.permute(2, 3, 1, 0)` gives this layout.

Groups split the input channels into `groups` blocks, each convolved with its own out_channels // groups
filters (XLA's feature_group_count, torch's `groups`). groups == in_channels is a depthwise convolution;
out_channels = k * in_channels adds a channel multiplier k, and output channel c * k + j reads input channel c.

Depthwise fast path. On CPU, XLA lowers a grouped convolution with one channel per group far more slowly than
the same arithmetic written out: pad once, then for each kernel tap (i, j) take the strided slice of the
padded image that the tap sees and multiply it by that tap's per-channel weights, and sum the kh * kw
products. `depthwise_impl="shifts"` does that, `"xla"` calls `lax.conv_general_dilated`, and `"auto"` picks
by backend from measurements (bench/conv.py, docs/benchmarks.md): shifts on CPU, XLA elsewhere (cuDNN has
dedicated depthwise kernels; no GPU measurement argues otherwise). Both give the same result and gradients to
float rounding (tests/purejax/nn/test_conv.py).
"""

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn import initializers
from purejax.nn._check import check_dim, check_keys
from purejax.nn._spatial import Padding, out_size, resolve_padding, to_pair

Params = dict[str, Array]
DepthwiseImpl = Literal["auto", "xla", "shifts"]

# Backends on which "auto" uses the shifted-slices depthwise path (measured: bench/conv.py).
SHIFTS_BACKENDS = ("cpu",)


def init(
    key: PRNGKeyArray,
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int],
    *,
    groups: int = 1,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.he_normal(),
    dtype: Any = jnp.float32,
) -> Params:
    """Kernel from `w_init`, bias zeros.

    The default is He normal (variance 2 / fan_in, fan_in = kh * kw * in_channels // groups) because
    convolutions are almost always followed by a ReLU-family activation (He et al. 2015). torchvision's
    MobileNetV2 uses He with fan_out: `initializers.variance_scaling(2.0, "fan_out", "normal")`.
    """
    kh, kw = to_pair("conv.init", "kernel_size", kernel_size)
    if in_channels <= 0 or out_channels <= 0:
        raise ValueError(f"conv.init: in_channels and out_channels must be positive, got {in_channels}, {out_channels}")
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise ValueError(
            f"conv.init: groups={groups} must be >= 1 and divide both in_channels={in_channels} and "
            f"out_channels={out_channels} (depthwise: groups=in_channels, out_channels a multiple of it)"
        )
    params = {"w": w_init(key, (kh, kw, in_channels // groups, out_channels), dtype)}
    if bias:
        params["b"] = jnp.zeros((out_channels,), dtype)
    return params


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch height width in_channels"],
    *,
    stride: int | Sequence[int] = 1,
    padding: Padding = "SAME",
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    depthwise_impl: DepthwiseImpl = "auto",
) -> Float[Array, "*batch out_height out_width out_channels"]:
    """Convolve `x` (NHWC; any number of leading batch axes, including none) with `params["w"]` (HWIO).

    Arguments:
        stride, dilation: an int or a (height, width) pair. Dilation spaces the kernel taps (atrous conv).
        padding: "SAME" (output size ceil(in / stride), extra pad at the bottom/right as XLA and TensorFlow),
            "VALID" (none), an int p (p on every side, as torch's `padding=p`), or ((top, bottom), (left, right)).
        groups: feature groups; must equal in_channels // params["w"].shape[2]. It is an argument rather than
            read from the shapes so that an input with the wrong channel count fails instead of silently
            becoming a different grouping.
        depthwise_impl: how a depthwise convolution (groups == in_channels) is computed; see the module
            docstring. "auto" and "xla" accept any grouping; "shifts" on a non-depthwise one is an error.
    """
    x = jnp.asarray(x)
    depthwise = _check(params, x, groups, depthwise_impl)
    w = params["w"]
    kh, kw = w.shape[:2]
    stride = to_pair("conv", "stride", stride)
    dilation = to_pair("conv", "dilation", dilation)
    in_hw = x.shape[-3:-1]
    pads = resolve_padding("conv", padding, in_hw, (kh, kw), stride, dilation)
    out_hw = tuple(out_size(n, p, k, s, d) for n, p, k, s, d in zip(in_hw, pads, (kh, kw), stride, dilation))
    if min(out_hw) < 1:
        raise ValueError(
            f"conv: a {kh}x{kw} kernel with dilation {dilation} does not fit the {in_hw} image padded by {pads}"
        )

    batch_shape = x.shape[:-3]
    x4 = x.reshape((-1, *x.shape[-3:]))  # lax convolutions take exactly one batch axis
    dtype = jnp.result_type(x4, w)
    x4, w = x4.astype(dtype), w.astype(dtype)
    auto_shifts = depthwise_impl == "auto" and jax.default_backend() in SHIFTS_BACKENDS
    if depthwise and (depthwise_impl == "shifts" or auto_shifts):
        y = _depthwise_shifts(x4, w, stride, pads, dilation, out_hw)
    else:
        y = jax.lax.conv_general_dilated(
            x4,
            w,
            stride,
            pads,
            rhs_dilation=dilation,
            feature_group_count=groups,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
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
    if w.ndim != 4:
        raise ValueError(
            f"conv: params['w'] must be (kh, kw, in_channels // groups, out_channels), got shape {w.shape}"
        )
    if x.ndim < 3:
        raise ValueError(f"conv: x must be (*batch, height, width, in_channels), got shape {x.shape}")
    _, _, in_per_group, out_channels = w.shape
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
    x: Float[Array, "batch height width channels"],
    w: Float[Array, "kh kw 1 out_channels"],
    stride: tuple[int, int],
    pads: tuple[tuple[int, int], tuple[int, int]],
    dilation: tuple[int, int],
    out_hw: tuple[int, ...],
) -> Float[Array, "batch out_height out_width out_channels"]:
    """Depthwise convolution as sum over taps (i, j) of padded_x[:, i*dh + sh*r, j*dw + sw*c, :] * w[i, j].

    Accumulates in float32 (or wider) and returns the input dtype, as XLA's convolution does."""
    n, _, _, channels = x.shape
    kh, kw, _, out_channels = w.shape
    multiplier = out_channels // channels
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xp = jnp.pad(x.astype(acc), ((0, 0), pads[0], pads[1], (0, 0)))
    taps = w.astype(acc).reshape(kh, kw, channels, multiplier)  # out channel c * multiplier + j -> [c, j]
    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out_hw
    y = None
    for i in range(kh):
        for j in range(kw):
            start = (0, i * dh, j * dw, 0)
            limit = (n, i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1, channels)
            patch = jax.lax.slice(xp, start, limit, (1, sh, sw, 1))
            term = patch[..., None] * taps[i, j] if multiplier > 1 else patch * taps[i, j, :, 0]
            y = term if y is None else y + term
    return y.reshape(n, oh, ow, out_channels).astype(x.dtype)
