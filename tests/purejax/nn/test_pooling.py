"""purejax.nn.pooling against numpy loops over output positions, with padding marked as NaN so that each
reference decides for itself whether padded positions count."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import pooling


def explicit_pads(padding, size, window, stride):
    if padding == "VALID":
        return ((0, 0), (0, 0))
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    if padding == "SAME":  # TensorFlow's rule: output ceil(n / stride), the odd pad goes after
        pads = []
        for n, k, s in zip(size, window, stride):
            total = max((-(-n // s) - 1) * s + k - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return padding


def numpy_pool(x, window, stride, padding, op, count_include_pad=False):
    x = np.asarray(x, np.float64)
    (ph, pw) = explicit_pads(padding, x.shape[1:3], window, stride)
    xp = np.pad(x, ((0, 0), ph, pw, (0, 0)), constant_values=np.nan)  # NaN marks padding
    (kh, kw), (sh, sw) = window, stride
    oh, ow = (xp.shape[1] - kh) // sh + 1, (xp.shape[2] - kw) // sw + 1
    y = np.zeros((x.shape[0], oh, ow, x.shape[3]))
    for r in range(oh):
        for c in range(ow):
            win = xp[:, r * sh : r * sh + kh, c * sw : c * sw + kw, :]
            if op == "max":
                y[:, r, c] = np.nanmax(win, axis=(1, 2))
            elif count_include_pad:
                y[:, r, c] = np.nansum(win, axis=(1, 2)) / (kh * kw)
            else:
                y[:, r, c] = np.nanmean(win, axis=(1, 2))
    return y


CASES = [  # (height, width, window, stride, padding)
    (8, 8, (2, 2), (2, 2), "VALID"),
    (7, 9, (3, 3), (2, 2), "VALID"),
    (8, 8, (3, 3), (2, 2), "SAME"),
    (7, 7, (3, 3), (2, 2), "SAME"),
    (6, 7, (3, 3), (1, 1), "SAME"),
    (6, 6, (3, 3), (1, 1), 1),
    (7, 6, (2, 3), (1, 2), ((1, 0), (0, 2))),
]


@pytest.mark.parametrize("h, w, window, stride, padding", CASES)
def test_max_and_avg_pool_match_numpy(h, w, window, stride, padding):
    x = np.random.default_rng(0).normal(size=(2, h, w, 3)).astype(np.float32)
    pools = jax.jit(
        lambda x: (
            pooling.max_pool(x, window, stride=stride, padding=padding),
            pooling.avg_pool(x, window, stride=stride, padding=padding),
            pooling.avg_pool(x, window, stride=stride, padding=padding, count_include_pad=True),
        )
    )
    y_max, y_avg, y_avg_incl = pools(jnp.asarray(x))
    np.testing.assert_allclose(y_max, numpy_pool(x, window, stride, padding, "max"), rtol=1e-6)
    np.testing.assert_allclose(y_avg, numpy_pool(x, window, stride, padding, "avg"), rtol=1e-5, atol=1e-6)
    want_incl = numpy_pool(x, window, stride, padding, "avg", count_include_pad=True)
    np.testing.assert_allclose(y_avg_incl, want_incl, rtol=1e-5, atol=1e-6)


def test_padding_does_not_count_in_avg_pool_by_default():
    x = jnp.full((1, 4, 4, 1), 2.0)
    # border windows average the real pixels only
    np.testing.assert_allclose(pooling.avg_pool(x, 3, stride=1, padding="SAME"), 2.0)
    with_pad = pooling.avg_pool(x, 3, stride=1, padding="SAME", count_include_pad=True)
    np.testing.assert_allclose(with_pad[0, 0, 0, 0], 2.0 * 4 / 9)  # corner: 4 real pixels out of 9
    np.testing.assert_allclose(with_pad[0, 1, 1, 0], 2.0)


def test_max_pool_padding_never_wins():
    x = jnp.full((1, 3, 3, 1), -5.0)
    np.testing.assert_allclose(pooling.max_pool(x, 3, stride=1, padding=1), -5.0)


def test_stride_defaults_to_window_and_leading_axes_are_kept():
    x = jnp.arange(2 * 3 * 4 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 4, 4, 2)
    y = pooling.max_pool(x, 2)
    chex.assert_shape(y, (2, 3, 2, 2, 2))
    np.testing.assert_allclose(y[1, 2], numpy_pool(x[1, 2][None], (2, 2), (2, 2), "VALID", "max")[0])
    chex.assert_shape(pooling.avg_pool(x[0, 0], 2), (2, 2, 2))  # a single unbatched image


def test_global_avg_pool_matches_numpy_and_keeps_dtype():
    x = np.random.default_rng(1).normal(size=(2, 5, 3, 4)).astype(np.float32)
    want = x.astype(np.float64).mean(axis=(1, 2))
    np.testing.assert_allclose(pooling.global_avg_pool(jnp.asarray(x)), want, rtol=1e-5)
    y = pooling.global_avg_pool(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(np.float32), x.mean(axis=(1, 2)), rtol=2e-2, atol=2e-2)


def test_bfloat16_in_bfloat16_out():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 4, 4, 2)), jnp.bfloat16)
    assert pooling.avg_pool(x, 2).dtype == pooling.max_pool(x, 2).dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------ errors


def test_errors_name_the_problem():
    x = jnp.ones((1, 4, 4, 2))
    with pytest.raises(ValueError, match="avg_pool: padding .* must be smaller than the window"):
        pooling.avg_pool(x, 2, stride=1, padding=2)
    with pytest.raises(ValueError, match="max_pool: a \\(5, 5\\) window does not fit"):
        pooling.max_pool(x, 5)
    with pytest.raises(ValueError, match="window must be an int or a \\(height, width\\) pair"):
        pooling.max_pool(x, (2, 2, 2))
    with pytest.raises(ValueError, match="padding must be 'SAME', 'VALID'"):
        pooling.avg_pool(x, 2, padding="same-ish")
    with pytest.raises(TypeCheckError):
        pooling.global_avg_pool(jnp.ones((4, 2)))
