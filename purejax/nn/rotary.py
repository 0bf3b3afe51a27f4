"""Rotary position embeddings (RoPE, Su et al. 2021, "RoFormer"): position enters attention by rotating each
query and key, so that the score q_m . k_n depends on the positions m and n only through m - n.

    q = rotary.apply(q, positions, theta=500000.0, scaling=rotary.Llama3Scaling())    # (batch, seq, n_head, head_dim)

Each head's head_dim features form head_dim / 2 pairs; pair i at position m is rotated by the angle
m * inv_freq[i], with inv_freq[i] = theta^(-2i / head_dim) (RoFormer eq. 15), so the first pairs turn fast
(short wavelengths, local order) and the last slowly (long wavelengths, far context). For a pair (a, b):

    (a, b) -> (a cos(m w) - b sin(m w),  b cos(m w) + a sin(m w))          w = inv_freq[i]

Which features pair up: here feature i with feature i + head_dim / 2 ("rotate-half", GPT-NeoX's and Hugging
Face's `rotate_half`), so Hugging Face's Llama q_proj / k_proj weights load as they are. Meta's original Llama
checkpoints pair neighbours (2i, 2i + 1) instead; the two are the same model up to a permutation of each
head's features, which Hugging Face's conversion script applies to q_proj and k_proj: `half_permutation`
gives it (`w_half = w_interleaved[..., perm]`, per head).

Context extension by rescaling the frequencies, two variants:
- `LinearScaling(factor)`: position interpolation (Chen et al. 2023): every inv_freq divided by `factor`,
  i.e. positions squeezed by it, so factor times the trained context maps onto the trained angles.
- `Llama3Scaling(...)`: Llama 3.1's scheme (Meta's `apply_scaling`; Hugging Face's `rope_type="llama3"`):
  wavelengths 2 pi / inv_freq shorter than original_max_seq_len / high_freq_factor are kept, longer than
  original_max_seq_len / low_freq_factor are divided by `factor`, and the band between is interpolated
  smoothly, s = (original_max_seq_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor),
  inv_freq' = (1 - s) inv_freq / factor + s inv_freq.

The frequencies depend only on static settings, so they are computed in float64 numpy at trace time and enter
the program as a constant; the angles and the rotation are computed in float32 whatever the input dtype.
Rotary has no parameters, so there is no init; it works per head, so under tensor parallelism every device
rotates its own heads with no communication.
"""

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Integer


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Chen et al. 2023; Hugging Face's `rope_type="linear"`): inv_freq / factor."""

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"LinearScaling: factor must be positive, got {self.factor!r}")

    def rescale(self, inv_freq: np.ndarray) -> np.ndarray:
        return inv_freq / self.factor


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency-dependent scaling (see the module docstring); the defaults are Llama 3.1's.
    `original_max_seq_len` is the context the model was first trained with (Hugging Face's
    `original_max_position_embeddings`); the others keep Meta's and Hugging Face's names."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if not (self.factor > 0 and self.low_freq_factor > 0 and self.original_max_seq_len > 0):
            raise ValueError(f"Llama3Scaling: factor, low_freq_factor, original_max_seq_len must be positive: {self}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"Llama3Scaling: high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                f"{self.low_freq_factor}: they bound the band of wavelengths that is interpolated"
            )

    def rescale(self, inv_freq: np.ndarray) -> np.ndarray:
        wavelength = 2 * math.pi / inv_freq
        smooth = (self.original_max_seq_len / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long_waves = wavelength > self.original_max_seq_len / self.low_freq_factor  # slow pairs: scaled fully
        short_waves = wavelength < self.original_max_seq_len / self.high_freq_factor  # fast pairs: kept
        return np.where(long_waves, inv_freq / self.factor, np.where(short_waves, inv_freq, interpolated))


RopeScaling = LinearScaling | Llama3Scaling


def inverse_frequencies(head_dim: int, *, theta: float = 10000.0, scaling: RopeScaling | None = None) -> np.ndarray:
    """The head_dim / 2 rotation frequencies theta^(-2i / head_dim), rescaled by `scaling`; float64 numpy."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary: head_dim must be a positive even int (features rotate in pairs), got {head_dim!r}")
    if not theta > 0:
        raise ValueError(f"rotary: theta must be positive, got {theta!r}")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return inv_freq if scaling is None else scaling.rescale(inv_freq)


def apply(
    x: Float[Array, "batch seq n_head head_dim"],
    positions: Integer[ArrayLike, "... seq"],
    *,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> Float[Array, "batch seq n_head head_dim"]:
    """`x` with each head's feature pairs (i, i + head_dim / 2) rotated by positions * inv_freq[i] (the module
    docstring). `positions` are absolute token positions, (seq,) for every row or (batch, seq) per row; when
    decoding with a cache they start at the number of positions already written."""
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"rotary: positions must be integers, got {positions.dtype}")
    half = x.shape[-1] // 2
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1], theta=theta, scaling=scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (..., seq, head_dim / 2)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # a head axis to broadcast over
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    a, b = x32[..., :half], x32[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def half_permutation(head_dim: int) -> np.ndarray:
    """Feature indices taking one head's interleaved pairs (2i, 2i + 1) (Meta's Llama checkpoints) to the
    rotate-half pairs (i, i + head_dim / 2) used here: even features first, then odd. Apply it per head to the
    output columns of the query and key projections; `np.argsort(perm)` goes back."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary.half_permutation: head_dim must be a positive even int, got {head_dim}")
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
