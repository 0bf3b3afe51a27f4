"""RMSprop (Hinton, Coursera lecture 6e, 2012): divide the gradient by a running root-mean-square of itself.

    nu = decay * nu + (1 - decay) * g**2          update = g / sqrt(nu + eps)
    centered (Graves 2013): also mu = decay * mu + (1 - decay) * g, and divide by sqrt(nu - mu**2 + eps)

With `eps_in_sqrt=False` the denominator is `sqrt(nu) + eps`, which is torch's form. With `bias_correction=True`
the running means are divided by `1 - decay**t` (t the step, from 1), as Adam does: `scale_by_rms(b2,
eps_in_sqrt=False, bias_correction=True)` is Adam with b1 = 0, without a first moment's memory. Momentum, if any, is
applied after the learning rate (optax's order; the same trajectory for a constant rate).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain, safe_increment, zero_count
from purejax.optim.base import bias_correction as debias  # `bias_correction` is scale_by_rms's flag, as in optax
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.sgd import trace


class RmsState(NamedTuple):
    """The running mean of squared gradients, one array per parameter; the step count with bias correction."""

    nu: PyTree
    count: Int[Array, ""] | None = None  # None (no leaf) unless bias_correction


class CenteredRmsState(NamedTuple):
    """The running means of gradients (`mu`) and of their squares (`nu`); the step count with bias correction."""

    mu: PyTree
    nu: PyTree
    count: Int[Array, ""] | None = None  # None (no leaf) unless bias_correction


def scale_by_rms(
    decay: ArrayLike = 0.9,
    eps: ArrayLike = 1e-8,
    initial_scale: ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Divide updates by the running RMS of the gradients (centered: by their running standard deviation).

    Arguments:
        decay: decay rate of the running averages (torch's `alpha`, default 0.99 there).
        eps: stabiliser in the denominator, inside the square root unless `eps_in_sqrt=False`.
        initial_scale: starting value of `nu` (TensorFlow's RMSprop starts at 1, torch and optax at 0).
        centered: subtract the squared running mean of the gradients from `nu`.
        bias_correction: divide the running means by `1 - decay**t` (optax's `bias_correction`); the state then
            also counts the steps.
    """

    def init(params: PyTree) -> RmsState | CenteredRmsState:
        nu = jax.tree_util.tree_map(lambda p: jnp.full_like(p, initial_scale), params)
        count = zero_count() if bias_correction else None
        if centered:
            return CenteredRmsState(jax.tree_util.tree_map(jnp.zeros_like, params), nu, count)
        return RmsState(nu, count)

    def update(updates: PyTree, state: RmsState | CenteredRmsState, params: PyTree = None) -> tuple[PyTree, PyTree]:
        del params
        # .astype: the state keeps its dtype whatever the gradients' (float32 grads of bfloat16 params would
        # otherwise widen it after the first step and retrace every jitted step, as adam and sgd also avoid)
        nu = jax.tree_util.tree_map(
            lambda g, v: ((1 - decay) * jnp.square(g) + decay * v).astype(v.dtype), updates, state.nu
        )
        mu = None
        if centered:
            mu = jax.tree_util.tree_map(lambda g, m: ((1 - decay) * g + decay * m).astype(m.dtype), updates, state.mu)
        count, mu_hat, nu_hat = None, mu, nu
        if bias_correction:
            count = safe_increment(state.count)
            mu_hat = None if mu is None else debias(mu, decay, count)
            nu_hat = debias(nu, decay, count)
        variance = nu_hat if mu is None else jax.tree_util.tree_map(lambda m, v: v - jnp.square(m), mu_hat, nu_hat)
        if eps_in_sqrt:
            scaling = jax.tree_util.tree_map(lambda v: jax.lax.rsqrt(v + eps), variance)
        else:
            scaling = jax.tree_util.tree_map(lambda v: 1 / (jnp.sqrt(v) + eps), variance)
        updates = jax.tree_util.tree_map(lambda s, g: s * g, scaling, updates)
        return updates, (CenteredRmsState(mu, nu, count) if centered else RmsState(nu, count))

    return GradientTransformation(init, update)


def rmsprop(
    learning_rate: ArrayLike | Schedule,
    decay: ArrayLike = 0.9,
    eps: ArrayLike = 1e-8,
    initial_scale: ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: ArrayLike | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    """RMSprop with optional centering, momentum and bias correction. State paths: `rms.nu.*` (`rms.mu.*`,
    `rms.count`), `lr.*`, `momentum.trace.*`. Defaults are optax's; torch's are `decay=0.99, eps=1e-8,
    eps_in_sqrt=False`."""
    parts = {
        "rms": scale_by_rms(decay, eps, initial_scale, eps_in_sqrt, centered, bias_correction),
        "lr": scale_by_learning_rate(learning_rate),
    }
    if momentum is not None:
        parts["momentum"] = trace(momentum, nesterov)
    elif nesterov:
        raise ValueError("rmsprop(nesterov=True) needs a momentum value, e.g. momentum=0.9")
    return chain(**parts)
