"""Weight initializers: each is a function `(key, shape, dtype) -> array`, made by a small factory, so that
every one is written alike whether it has settings or not: `zeros()`, `normal(0.02)`, `he_normal()`.

Fan-in and fan-out follow the layouts purejax uses: a linear weight is (d_in, d_out) and a conv kernel is
HWIO (kh, kw, in, out), so fan_in = receptive field * shape[-2] and fan_out = receptive field * shape[-1]
(the same convention as `jax.nn.initializers` with its default in_axis=-2, out_axis=-1).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

Initializer = Callable[[PRNGKeyArray, Sequence[int], Any], Array]

# std of a unit normal truncated to [-2, 2]; dividing by it makes truncated samples have the requested variance.
_TRUNCATED_NORMAL_STD = 0.87962566103423978


def zeros() -> Initializer:
    """All zeros (biases; the adaLN-Zero modulation of DiT, so a block starts as the identity)."""

    def init(key: PRNGKeyArray | None, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        del key  # deterministic; taken so that every initializer is called alike
        return jnp.zeros(shape, dtype)

    return init


def ones() -> Initializer:
    """All ones (norm scales)."""

    def init(key: PRNGKeyArray | None, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        del key
        return jnp.ones(shape, dtype)

    return init


def normal(stddev: float = 1.0) -> Initializer:
    """N(0, stddev^2). GPT-2 and nanoGPT use stddev 0.02."""

    def init(key: PRNGKeyArray, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        return stddev * jax.random.normal(key, shape, dtype)

    return init


def truncated_normal(stddev: float = 1.0, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """stddev * a unit normal truncated to [lower, upper] (not rescaled: the result's std is below stddev)."""

    def init(key: PRNGKeyArray, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        return stddev * jax.random.truncated_normal(key, lower, upper, shape, dtype)

    return init


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of `shape` in purejax's (…, in, out) layout."""
    if len(shape) < 2:
        raise ValueError(f"fan-in/fan-out need a weight of at least 2 dimensions, got shape {tuple(shape)}")
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def variance_scaling(
    scale: float,
    mode: Literal["fan_in", "fan_out", "fan_avg"],
    distribution: Literal["truncated_normal", "normal", "uniform"],
) -> Initializer:
    """Samples with variance `scale / n`, n the fan-in, fan-out or their mean (Glorot & Bengio 2010; He et al. 2015).

    `truncated_normal` draws from [-2, 2] and rescales so the variance is exactly scale / n."""
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError(f"mode must be fan_in, fan_out or fan_avg, got {mode!r}")
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError(f"distribution must be truncated_normal, normal or uniform, got {distribution!r}")

    def init(key: PRNGKeyArray, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        fan_in, fan_out = fans(shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        variance = scale / max(1.0, n)
        if distribution == "truncated_normal":
            std = math.sqrt(variance) / _TRUNCATED_NORMAL_STD
            return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)
        if distribution == "normal":
            return math.sqrt(variance) * jax.random.normal(key, shape, dtype)
        limit = math.sqrt(3.0 * variance)
        return jax.random.uniform(key, shape, dtype, -limit, limit)

    return init


def lecun_normal() -> Initializer:
    """variance 1/fan_in, truncated normal (LeCun 1998; the default for linear layers here, as in Flax)."""
    return variance_scaling(1.0, "fan_in", "truncated_normal")


def he_normal() -> Initializer:
    """variance 2/fan_in, truncated normal: for ReLU networks (He et al. 2015)."""
    return variance_scaling(2.0, "fan_in", "truncated_normal")


def he_uniform() -> Initializer:
    return variance_scaling(2.0, "fan_in", "uniform")


def xavier_uniform() -> Initializer:
    """variance 2/(fan_in + fan_out), uniform (Glorot & Bengio 2010; DiT's linear layers)."""
    return variance_scaling(1.0, "fan_avg", "uniform")


def xavier_normal() -> Initializer:
    return variance_scaling(1.0, "fan_avg", "truncated_normal")
