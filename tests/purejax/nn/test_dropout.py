"""purejax.nn.dropout: identity without a key, inverted scaling with one, keep rate and expectation on a large
sample, gradients, and errors for impossible rates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import dropout

N = 1 << 16


def test_no_key_is_the_identity():
    x = jnp.arange(6.0).reshape(2, 3)
    assert dropout.apply(x, rate=0.5) is x
    assert dropout.apply(x, rate=0.5, key=None) is x


def test_rate_zero_is_the_identity_even_with_a_key():
    x = jnp.arange(6.0)
    assert dropout.apply(x, rate=0.0, key=jax.random.key(0)) is x


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_values_are_scaled_and_the_rest_zero(rate):
    x = jnp.asarray(np.random.default_rng(1).normal(3.0, 1.0, N), jnp.float32)  # no exact zeros in x
    y = np.asarray(dropout.apply(x, rate=rate, key=jax.random.key(2)))
    kept = y != 0
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
    # keep fraction: binomial standard error is at most 0.002 for N = 2^16; 0.015 is over 7 of them
    assert abs(kept.mean() - (1 - rate)) < 0.015
    # the expectation is preserved (inverted dropout): mean of y vs mean of x
    assert abs(y.mean() - float(x.mean())) < 0.05 * float(x.mean()) / (1 - rate) ** 0.5


def test_matches_an_independent_bernoulli_mask():
    x = jnp.asarray(np.random.default_rng(3).normal(size=N), jnp.float32)
    key = jax.random.key(4)
    keep = np.asarray(jax.random.bernoulli(key, 0.7, x.shape))
    want = np.where(keep, np.asarray(x, np.float64) / 0.7, 0.0)
    np.testing.assert_allclose(dropout.apply(x, rate=0.3, key=key), want, rtol=1e-6)


def test_same_key_same_mask_and_different_keys_different_masks():
    x = jnp.ones((N,))
    a = dropout.apply(x, rate=0.5, key=jax.random.key(0))
    chex.assert_trees_all_equal(a, dropout.apply(x, rate=0.5, key=jax.random.key(0)))
    assert not np.array_equal(a, dropout.apply(x, rate=0.5, key=jax.random.key(1)))


def test_keeps_dtype_and_shape():
    x = jnp.ones((N // 256, 256), jnp.bfloat16)
    y = dropout.apply(x, rate=0.5, key=jax.random.key(0))
    assert y.dtype == jnp.bfloat16
    chex.assert_shape(y, (N // 256, 256))
    assert set(np.unique(np.asarray(y, np.float32))) <= {0.0, 2.0}


def test_gradient_is_the_scaled_mask_and_works_under_jit():
    x = jnp.asarray(np.random.default_rng(5).normal(size=N), jnp.float32)
    key = jax.random.key(6)
    grad = jax.jit(jax.grad(lambda x, k: jnp.sum(dropout.apply(x, rate=0.25, key=k))))(x, key)
    keep = np.asarray(jax.random.bernoulli(key, 0.75, x.shape))
    np.testing.assert_allclose(grad, keep / 0.75, rtol=1e-6)


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1])
def test_impossible_rates(rate):
    with pytest.raises(ValueError, match=rf"dropout: rate must be in \[0, 1\), got {rate}"):
        dropout.apply(jnp.ones(3), rate=rate, key=jax.random.key(0))
    with pytest.raises(ValueError, match="rate must be in"):  # even without a key: a bad config fails in evaluation too
        dropout.apply(jnp.ones(3), rate=rate)


def test_int_input_fails_at_the_call_naming_the_argument():
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        dropout.apply(jnp.arange(3), rate=0.5, key=jax.random.key(0))


def test_the_flat_draw_equals_a_draw_of_the_input_shape():
    """dropout draws its mask flat (XLA:CPU compiles high-rank draws slowly); the bits must be the same as
    drawing `bernoulli` in the input's shape directly, so the shortcut changes nothing."""
    x, key = jnp.ones((2, 3, 4, 5)), jax.random.key(3)
    direct = jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x / 0.5, 0.0)
    np.testing.assert_array_equal(dropout.apply(x, rate=0.5, key=key), direct)
