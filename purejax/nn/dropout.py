"""Dropout (Srivastava et al. 2014), inverted: kept values are divided by (1 - rate) so evaluation needs no
rescaling. No key means evaluation: the input comes back unchanged. There is no hidden train/eval flag.

Dropout has no params, so no init, and its one setting is called `rate` here (Flax's and Keras' name); the
layers and configs that include a dropout among other settings call the same rate `dropout` (torch's
`nn.Transformer`, nanoGPT).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from purejax.nn._check import check_rate


def apply(x: Float[ArrayLike, "*shape"], *, rate: float, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
    """Zero each element with probability `rate` and scale the rest by 1/(1 - rate); `x` unchanged when `key`
    is None or `rate` is 0."""
    check_rate("dropout", rate)
    x = jnp.asarray(x)  # a jax array comes back as itself
    if key is None or rate == 0.0:
        return x
    return jnp.where(keep_mask(key, rate, x.shape), x / (1.0 - rate), jnp.zeros_like(x))


def keep_mask(key: PRNGKeyArray, rate: float, shape: tuple[int, ...]) -> Bool[Array, "*shape"]:
    """The mask `apply` draws for an input of `shape`: True where a value is kept (probability 1 - rate).
    Sequence parallelism (purejax/parallel/sequence.py) draws the whole mask and keeps its own slice of it."""
    # Drawn flat, then reshaped: the same bits (threefry's output does not depend on the rank), but XLA:CPU
    # compiles a rank-5 draw many times more slowly than a flat one.
    return jax.random.bernoulli(key, 1.0 - rate, (int(np.prod(shape)),)).reshape(shape)
