"""Patch embedding, the stem of ViT (Dosovitskiy et al. 2021) and DiT (Peebles & Xie 2023): an image cut into
non-overlapping patch_size x patch_size squares, each projected to a d_model-wide token.

params: {"w": (patch_size * patch_size * in_channels, d_model), "b": (d_model,)}; "b" is absent when bias=False.

The papers write it as a convolution with a patch_size x patch_size kernel and stride patch_size. Here it is the
same arithmetic as a reshape and a linear layer: `patchify` lays each patch out as one row, flattened in (row,
column, channel) order, and the patches row-major over the grid, then one matmul projects every row. Why not a
convolution: the strides equal the kernel, so no two patches share a pixel and the convolution is exactly that
matmul; written as one, it runs as a plain 2-D product on every backend and the weight is a linear layer's,
so `w` is the convolution's HWIO kernel (patch_size, patch_size, in_channels, d_model) reshaped to two axes:
`w.reshape(patch_size, patch_size, in_channels, d_model)` gives it back (tests/purejax/nn/test_patch_embedding.py
checks the two agree). torch's Conv2d weight (d_model, in_channels, p, p) converts as
`w_torch.permute(2, 3, 1, 0).reshape(-1, d_model)`.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Shaped

from purejax.nn import initializers, linear
from purejax.nn._check import check_keys

Params = dict[str, Array]


def init(
    key: PRNGKeyArray,
    in_channels: int,
    d_model: int,
    patch_size: int,
    *,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    dtype: Any = jnp.float32,
) -> Params:
    """The projection of one flattened patch (patch_size * patch_size * in_channels values) to d_model; weight
    from `w_init` (default LeCun normal, over the patch's fan-in), bias zeros."""
    for name, value in (("in_channels", in_channels), ("d_model", d_model), ("patch_size", patch_size)):
        if value <= 0:
            raise ValueError(f"patch_embedding.init: {name} must be positive, got {name}={value}")
    return linear.init(key, patch_size * patch_size * in_channels, d_model, bias=bias, w_init=w_init, dtype=dtype)


def apply(
    params: Params, x: Float[ArrayLike, "batch height width in_channels"], *, patch_size: int
) -> Float[Array, "batch seq d_model"]:
    """One token per patch, row-major over the (height / patch_size, width / patch_size) grid:
    seq = (height // patch_size) * (width // patch_size). Height and width must be multiples of patch_size."""
    x = jnp.asarray(x)
    check_keys(params, "patch_embedding", required=("w",), optional=("b",))
    patches = patchify(x, patch_size)
    if params["w"].shape[0] != patches.shape[-1]:
        raise ValueError(
            f"patch_embedding: params['w'] has shape {tuple(params['w'].shape)}, but patch_size={patch_size} and "
            f"x of shape {tuple(x.shape)} ({x.shape[-1]} channels) need {patches.shape[-1]} rows "
            f"(patch_size * patch_size * in_channels); were the params made for another patch size or image?"
        )
    return linear.apply(params, patches)


def patchify(
    x: Shaped[ArrayLike, "batch height width channels"], patch_size: int
) -> Shaped[Array, "batch seq patch_dim"]:
    """Non-overlapping patch_size x patch_size squares, row-major over the grid, each flattened in (row, column,
    channel) order: (batch, height, width, channels) -> (batch, seq, patch_size * patch_size * channels)."""
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"patch_embedding: x has shape {tuple(x.shape)}, expected (batch, height, width, channels)")
    batch, height, width, channels = x.shape
    if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size <= 0:
        raise ValueError(f"patch_embedding: patch_size must be a positive int, got {patch_size!r}")
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"patch_embedding: x has height={height} and width={width} (shape {tuple(x.shape)}), which must both "
            f"be multiples of patch_size={patch_size}; crop or pad the image to a multiple of the patch size"
        )
    rows, cols = height // patch_size, width // patch_size
    x = x.reshape(batch, rows, patch_size, cols, patch_size, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, rows * cols, patch_size * patch_size * channels)
