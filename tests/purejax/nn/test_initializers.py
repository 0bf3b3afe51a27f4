"""purejax.nn.initializers: the same draws as jax.nn.initializers for the same key (where the maths is the
same), and moments and bounds against the formulas on large samples.

Tolerances on moments are many standard errors wide (a sample of n = 2^19 values has a variance within about
0.2% of the true one, and we allow 3%), so the checks cannot flake for any key, yet a wrong fan or a missing
truncation correction (12% in variance) fails them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import initializers as init

TRUNCATED_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]
# An "rbg" key: the initializers do not care which PRNG makes the bits, and compiling the default threefry
# generator costs seconds per distribution, dtype and shape on CPU, which would dominate this file's run time.
KEY = jax.random.key(0, impl="rbg")
HWIO = (3, 3, 4, 8)


SAME_AS_JAX = {  # purejax initializer, jax.nn.initializers counterpart
    "lecun_normal": (init.lecun_normal(), jax.nn.initializers.lecun_normal()),
    "he_normal": (init.he_normal(), jax.nn.initializers.he_normal()),
    "he_uniform": (init.he_uniform(), jax.nn.initializers.he_uniform()),
    "xavier_uniform": (init.xavier_uniform(), jax.nn.initializers.xavier_uniform()),
    "xavier_normal": (init.xavier_normal(), jax.nn.initializers.xavier_normal()),
    "normal": (init.normal(0.02), jax.nn.initializers.normal(0.02)),
    "truncated_normal": (init.truncated_normal(0.5), jax.nn.initializers.truncated_normal(0.5)),
    "zeros": (init.zeros(), jax.nn.initializers.zeros),
    "ones": (init.ones(), jax.nn.initializers.ones),
}


@pytest.mark.parametrize("name", SAME_AS_JAX)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_values_as_jax_initializers_for_the_same_key(name, dtype):
    ours, theirs = SAME_AS_JAX[name]
    # One HWIO kernel shape (fan_in 48 != fan_out 72, receptive field 9) for all: every new shape costs a compile
    # of the random-bits kernel, and `fans` has its own test for other layouts.
    shape = HWIO
    got, want = ours(KEY, shape, dtype), theirs(KEY, shape, dtype)
    assert got.shape == shape and got.dtype == dtype
    # float32: the same maths to one rounding. bfloat16: jax scales in bfloat16 (and draws uniforms as
    # lo + (hi - lo) * u there) while purejax computes the scale in float64 first: a few bfloat16 ulps apart.
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulps = 1e-6 if dtype == jnp.float32 else 4 * float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=ulps, atol=ulps * np.abs(want).max())


@pytest.mark.parametrize("mode", ["fan_in", "fan_out", "fan_avg"])
@pytest.mark.parametrize("distribution", ["truncated_normal", "normal", "uniform"])
def test_variance_scaling_matches_jax_for_every_mode_and_distribution(mode, distribution):
    got = init.variance_scaling(0.7, mode, distribution)(KEY, HWIO, jnp.float32)
    want = jax.nn.initializers.variance_scaling(0.7, mode, distribution)(KEY, HWIO, jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_fans_follow_the_in_out_layout():
    assert init.fans((7, 9)) == (7, 9)
    assert init.fans((3, 3, 4, 8)) == (36, 72)  # HWIO: receptive field 9
    assert init.fans((5, 2, 3)) == (10, 15)
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got shape \(9,\)"):
        init.fans((9,))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        init.lecun_normal()(KEY, (9,), jnp.float32)


# --------------------------------------------------------------------------- moments on large samples
SHAPE = (512, 1024)  # fan_in 512, fan_out 1024, n = 2^19 samples
FAN_IN, FAN_OUT = SHAPE


def moments(x):
    x = np.asarray(x, np.float64).ravel()
    return x.mean(), x.var(), np.abs(x).max()


def truncated_bound(variance):
    """The largest draw of a normal truncated at 2 std and rescaled to `variance`."""
    return 2 * math.sqrt(variance) / TRUNCATED_STD


AVG = (FAN_IN + FAN_OUT) / 2


MOMENTS = [  # name, initializer, variance, largest possible |draw| (None: unbounded)
    ("lecun_normal", init.lecun_normal(), 1 / FAN_IN, truncated_bound(1 / FAN_IN)),
    ("he_normal", init.he_normal(), 2 / FAN_IN, truncated_bound(2 / FAN_IN)),
    ("xavier_normal", init.xavier_normal(), 1 / AVG, truncated_bound(1 / AVG)),
    ("he_uniform", init.he_uniform(), 2 / FAN_IN, math.sqrt(6 / FAN_IN)),
    ("xavier_uniform", init.xavier_uniform(), 1 / AVG, math.sqrt(3 / AVG)),
    ("truncated_normal(1)", init.truncated_normal(1.0), TRUNCATED_STD**2, 2.0),  # not rescaled, as documented
    ("fan_out", init.variance_scaling(3.0, "fan_out", "truncated_normal"), 3 / FAN_OUT, truncated_bound(3 / FAN_OUT)),
    ("normal(0.02)", init.normal(0.02), 0.02**2, None),
    ("fan_avg normal", init.variance_scaling(2.0, "fan_avg", "normal"), 2 / AVG, None),
]


@pytest.mark.parametrize("name, fn, variance, bound", MOMENTS, ids=[row[0] for row in MOMENTS])
def test_moments_and_bounds_follow_the_formula(name, fn, variance, bound):
    mean, var, largest = moments(fn(jax.random.key(42, impl="rbg"), SHAPE, jnp.float32))
    std = math.sqrt(variance)
    assert abs(mean) < 0.02 * std, name  # standard error of the mean is 0.0014 std
    assert var == pytest.approx(variance, rel=0.03), name
    if bound is None:  # a plain normal: 2^19 draws reach past 4.5 std
        assert largest > 4.5 * std, name
    else:  # truncated or uniform: within the bound, and filling it (no draw beyond, but some near it)
        assert bound * 0.98 < largest <= bound * (1 + 1e-6), name


def test_uniform_and_normal_are_told_apart_by_kurtosis():
    def kurtosis(x):
        x = np.asarray(x, np.float64).ravel()
        return np.mean((x - x.mean()) ** 4) / x.var() ** 2

    assert kurtosis(init.he_uniform()(KEY, SHAPE, jnp.float32)) == pytest.approx(1.8, abs=0.05)  # uniform: 9/5
    normal = init.variance_scaling(1.0, "fan_in", "normal")
    assert kurtosis(normal(KEY, SHAPE, jnp.float32)) == pytest.approx(3.0, abs=0.1)


def test_zeros_and_ones():
    np.testing.assert_array_equal(init.zeros()(KEY, (2, 3), jnp.bfloat16), np.zeros((2, 3)))
    assert init.zeros()(KEY, (2, 3), jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(init.ones()(KEY, (4,)), np.ones(4))


def test_different_keys_give_different_draws_and_the_same_key_the_same():
    key = lambda seed: jax.random.key(seed, impl="rbg")  # noqa: E731
    a, b = init.lecun_normal()(key(0), HWIO), init.lecun_normal()(key(1), HWIO)
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, init.lecun_normal()(key(0), HWIO))


@pytest.mark.parametrize(
    "mode, distribution, bad", [("fan_middle", "normal", "mode"), ("fan_in", "gaussian", "distribution")]
)
def test_variance_scaling_refuses_unknown_options(mode, distribution, bad):
    # the module's own ValueError, or beartype's check of the Literal annotation when the test hook is active
    with pytest.raises((ValueError, TypeError), match=bad):
        init.variance_scaling(1.0, mode, distribution)
