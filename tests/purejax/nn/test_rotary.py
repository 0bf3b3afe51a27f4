"""purejax.nn.rotary against float64 numpy: the rotate-half rotation, the frequencies with linear and Llama 3.1
scaling (Meta's `apply_scaling` loop, in tests/models/llama_numpy.py), the relative-position property,
and the permutation relating Meta's interleaved pairs to rotate-half."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import rotary
from purejax.nn.rotary import LinearScaling, Llama3Scaling
from tests.models import llama_numpy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 5, 3, 8)).astype(np.float32)  # (batch, seq, n_head, head_dim)
LLAMA31 = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)


def numpy_rotary(x, positions, inv_freq):
    """Pair (i, i + head_dim / 2) of every head rotated by the angle position * inv_freq[i], pair by pair."""
    x = np.asarray(x, np.float64)
    out, half = np.empty_like(x), x.shape[-1] // 2
    positions = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])
    for b, s, i in np.ndindex(x.shape[0], x.shape[1], half):
        angle = positions[b, s] * inv_freq[i]
        a, c = x[b, s, :, i], x[b, s, :, i + half]
        out[b, s, :, i] = a * math.cos(angle) - c * math.sin(angle)
        out[b, s, :, i + half] = c * math.cos(angle) + a * math.sin(angle)
    return out


def test_frequencies_are_theta_to_the_minus_2i_over_head_dim():
    want = [10000.0 ** (-2 * i / 8) for i in range(4)]
    np.testing.assert_allclose(rotary.inverse_frequencies(8), want, rtol=1e-15)
    np.testing.assert_allclose(rotary.inverse_frequencies(8, theta=500000.0)[1], 500000.0**-0.25, rtol=1e-15)


@pytest.mark.parametrize("scaling", [None, LinearScaling(4.0), LLAMA31], ids=["none", "linear", "llama3"])
def test_apply_matches_float64_numpy(scaling):
    positions = np.array([0, 3, 7, 100, 20000])
    inv_freq = llama_numpy.inverse_frequencies(8, 500000.0, scaling)
    got = rotary.apply(jnp.asarray(X), positions, theta=500000.0, scaling=scaling)
    # float32 angles of positions up to 2e4 are good to about 2e4 * 2^-24 ~ 1e-3 rad
    np.testing.assert_allclose(got, numpy_rotary(X, positions, inv_freq), atol=3e-3)
    near = rotary.apply(jnp.asarray(X[:, :3]), positions[:3], theta=500000.0, scaling=scaling)
    np.testing.assert_allclose(near, numpy_rotary(X[:, :3], positions[:3], inv_freq), atol=2e-6)


def test_positions_per_row():
    positions = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    got = rotary.apply(jnp.asarray(X), positions)
    np.testing.assert_allclose(got, numpy_rotary(X, positions, rotary.inverse_frequencies(8)), atol=2e-6)


def test_linear_scaling_squeezes_positions_by_the_factor():
    np.testing.assert_allclose(
        rotary.inverse_frequencies(16, scaling=LinearScaling(2.5)), rotary.inverse_frequencies(16) / 2.5, rtol=1e-15
    )
    want = numpy_rotary(X, np.arange(5) / 2.5, rotary.inverse_frequencies(8))
    np.testing.assert_allclose(rotary.apply(jnp.asarray(X), jnp.arange(5), scaling=LinearScaling(2.5)), want, atol=2e-6)


def test_llama3_scaling_matches_meta_apply_scaling():
    """Llama 3.1's own settings (head_dim 128, theta 5e5), where all three wavelength bands occur, and a small
    context where the band edges fall between other frequencies."""
    for head_dim, theta, scaling in [(128, 500000.0, LLAMA31), (64, 10000.0, Llama3Scaling(4.0, 2.0, 8.0, 256))]:
        base = rotary.inverse_frequencies(head_dim, theta=theta)
        got = rotary.inverse_frequencies(head_dim, theta=theta, scaling=scaling)
        np.testing.assert_allclose(got, llama_numpy.inverse_frequencies(head_dim, theta, scaling), rtol=1e-14)
        kept, divided = np.isclose(got, base, rtol=1e-12), np.isclose(got, base / scaling.factor, rtol=1e-12)
        assert kept.any() and divided.any() and (~kept & ~divided).any()  # every band is exercised
        assert np.all(np.diff(got) < 0)  # the smooth band joins the other two monotonically


def test_scores_depend_only_on_the_relative_position():
    """q_m . k_n after rotation is the same for (m, n) and (m + t, n + t): RoFormer's defining property."""
    q, k = (jnp.asarray(RNG.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))
    for scaling in (None, LLAMA31):

        def score(m, n, scaling=scaling):
            rq = rotary.apply(q, jnp.array([m]), scaling=scaling)
            rk = rotary.apply(k, jnp.array([n]), scaling=scaling)
            return float(jnp.sum(rq * rk))

        assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-4)
        assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-5)
        assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)  # and it does depend on m - n


def test_meta_interleaved_pairs_are_a_permutation_of_rotate_half():
    """Meta's reference rotates neighbours (2i, 2i + 1) as complex numbers times e^(i m w); permuting each head's
    features by `half_permutation` turns that into this module's rotation."""
    positions = np.arange(5)
    inv_freq = rotary.inverse_frequencies(8)
    pairs = X.astype(np.float64).reshape(*X.shape[:-1], 4, 2)
    z = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * positions[None, :, None, None] * inv_freq)
    meta = np.stack([z.real, z.imag], axis=-1).reshape(X.shape)
    perm = rotary.half_permutation(8)
    np.testing.assert_array_equal(perm, [0, 2, 4, 6, 1, 3, 5, 7])
    got = rotary.apply(jnp.asarray(X[..., perm]), positions)
    np.testing.assert_allclose(np.asarray(got)[..., np.argsort(perm)], meta, atol=2e-6)


def test_low_precision_input_keeps_its_dtype_and_rotates_in_float32():
    got = rotary.apply(jnp.asarray(X, jnp.bfloat16), jnp.arange(5))
    assert got.dtype == jnp.bfloat16
    want = numpy_rotary(
        np.asarray(jnp.asarray(X, jnp.bfloat16), np.float64), np.arange(5), rotary.inverse_frequencies(8)
    )
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)


def test_jit_and_traced_positions():
    f = jax.jit(lambda x, start: rotary.apply(x, start + jnp.arange(5), theta=500000.0))
    want = rotary.apply(jnp.asarray(X), np.arange(3, 8), theta=500000.0)
    np.testing.assert_allclose(f(jnp.asarray(X), 3), want, rtol=1e-6, atol=1e-6)  # jit may fuse differently


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="head_dim must be a positive even int"):
        rotary.apply(jnp.ones((1, 2, 1, 5)), jnp.arange(2))
    with pytest.raises(TypeError, match="positions"):  # jaxtyping in the tests, rotary itself without
        rotary.apply(jnp.asarray(X), jnp.arange(5.0))
    with pytest.raises(ValueError, match="theta must be positive"):
        rotary.inverse_frequencies(8, theta=0.0)
    with pytest.raises(ValueError, match="factor must be positive"):
        LinearScaling(0.0)
    with pytest.raises(ValueError, match="high_freq_factor=1.0 must exceed low_freq_factor=4.0"):
        Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0)


def test_scalings_are_hashable_static_settings():
    assert hash(Llama3Scaling()) == hash(LLAMA31) and LinearScaling(2.0) == LinearScaling(2.0)
