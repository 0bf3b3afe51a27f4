"""What DiT makes of its inputs before the transformer: an image cut into patch tokens (and put back together),
the fixed 2-D sin-cos positions of those tokens, and the sinusoidal features of the diffusion time.

None of them has parameters; `models.dit` adds the learned parts (the patch projection, the
timestep MLP). The three conventions here are the ones DiT's checkpoints (and diffusers' conversions of
them) were trained with, so those weights see the inputs they expect:

    patchify:    patch p x p, flattened in (row, column, channel) order, patches row-major over the grid
                 (purejax.nn.patch_embedding's, the stem DiT shares with ViT)
    positions:   first half of the features encode the column, second half the row (MAE's and DiT's table)
    time:        [cos | sin] of t * f_i, f_i = max_period^(-i / (half - freq_shift))
"""

import math

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real, Shaped

from purejax.nn.patch_embedding import patchify  # noqa: F401 - re-exported: DiT's patchify is the shared stem's


def unpatchify(
    tokens: Shaped[Array, "batch seq patch_dim"], patch: int, channels: int
) -> Shaped[Array, "batch height width channels"]:
    """The inverse of `patchify` for a square grid (DiT's `unpatchify`)."""
    b, seq, _ = tokens.shape
    grid = math.isqrt(seq)
    x = tokens.reshape(b, grid, grid, patch, patch, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, grid * patch, grid * patch, channels)


def sincos_1d(d: int, positions: Real[ArrayLike, " n"]) -> Float[Array, "n d"]:
    """[sin(p * w_i), cos(p * w_i)] with w_i = 10000^(-i / (d/2)), i < d/2 (MAE's and DiT's 1-D table)."""
    omega = 1.0 / 10000.0 ** (jnp.arange(d // 2, dtype=jnp.float32) / (d // 2))
    angles = jnp.asarray(positions, jnp.float32)[:, None] * omega
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def sincos_2d(d: int, grid: int) -> Float[Array, "seq d"]:
    """Fixed 2-D positions for a row-major grid x grid of tokens: the first d/2 features encode the column,
    the last d/2 the row. (DiT's `get_2d_sincos_pos_embed` builds `meshgrid(w, h)`, so its half named "h"
    is the column; this matches it, so DiT checkpoints see the positions they were trained with.)"""
    rows, cols = jnp.divmod(jnp.arange(grid * grid), grid)
    return jnp.concatenate([sincos_1d(d // 2, cols), sincos_1d(d // 2, rows)], axis=-1)


def timestep_embedding(
    t: Real[ArrayLike, " batch"], dim: int, *, max_period: float = 10000.0, freq_shift: float = 0.0
) -> Float[Array, "batch dim"]:
    """[cos(t * f_i), sin(t * f_i)], f_i = exp(-ln(max_period) * i / (half - freq_shift)), i < half = dim // 2,
    float32; an odd dim gets a zero last column. freq_shift 0 is DiT's convention, 1 diffusers' (whose
    `flip_sin_to_cos=True` also puts the cosines first)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    angles = jnp.asarray(t, jnp.float32)[:, None] * freqs
    emb = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))
