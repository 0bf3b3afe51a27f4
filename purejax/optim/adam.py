"""Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019).

Per parameter, with g the gradient and t the step (1 on the first update):

    mu = b1 * mu + (1 - b1) * g                  nu = b2 * nu + (1 - b2) * g**2
    update = mu_hat / (sqrt(nu_hat + eps_root) + eps),   mu_hat = mu / (1 - b1**t),  nu_hat = nu / (1 - b2**t)

With `nesterov=True` (NAdam, Dozat 2016) the first moment looks one step ahead:
`mu_hat = b1 * mu / (1 - b1**(t+1)) + (1 - b1) * g / (1 - b1**t)`, as in optax (which, like other NAdams,
leaves out the extra factor b2 on nu_hat of Dozat's Algorithm 2).

AdamW is Adam, then `+ weight_decay * params` (on the masked leaves), then `* -learning_rate`; the decay is
outside the moment estimates, so it is not rescaled by them. The moments are the only parameter-sized state.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Int

from purejax.optim.base import (
    GradientTransformation,
    PyTree,
    Schedule,
    bias_correction,
    chain,
    safe_increment,
    zero_count,
)
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.weight_decay import Mask, add_decayed_weights


class AdamState(NamedTuple):
    """Steps taken, and the first (`mu`) and second (`nu`) moment estimates, one array per parameter each."""

    count: Int[Array, ""]
    mu: PyTree
    nu: PyTree


def scale_by_adam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: DTypeLike | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moment ratio (no learning rate, no sign flip).

    Arguments:
        b1, b2: decay rates of the first and second moment averages (torch's `betas`).
        eps: added to the denominator outside the square root (torch's `eps`).
        eps_root: added inside the square root (keeps the update differentiable at nu = 0).
        mu_dtype: dtype of the first moment (e.g. bfloat16 to save memory); default: each parameter's dtype.
        nesterov: Nesterov momentum (NAdam, Dozat 2016), as optax's `nesterov`. Not `torch.optim.NAdam`, whose
            momentum also follows a decay schedule (`momentum_decay`).
    """

    def init(params: PyTree) -> AdamState:
        mu = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
        nu = jax.tree_util.tree_map(jnp.zeros_like, params)
        return AdamState(zero_count(), mu, nu)

    def update(updates: PyTree, state: AdamState, params: PyTree = None) -> tuple[PyTree, AdamState]:
        del params
        mu = jax.tree_util.tree_map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree_util.tree_map(lambda g, v: (1 - b2) * jnp.square(g) + b2 * v, updates, state.nu)
        count = safe_increment(state.count)
        if nesterov:
            ahead, now = bias_correction(mu, b1, safe_increment(count)), bias_correction(updates, b1, count)
            mu_hat = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, ahead, now)
        else:
            mu_hat = bias_correction(mu, b1, count)
        nu_hat = bias_correction(nu, b2, count)
        updates = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        mu = jax.tree_util.tree_map(lambda m, old: m.astype(old.dtype), mu, state.mu)
        nu = jax.tree_util.tree_map(lambda v, old: v.astype(old.dtype), nu, state.nu)
        return updates, AdamState(count, mu, nu)

    return GradientTransformation(init, update)


def adam(
    learning_rate: ArrayLike | Schedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: DTypeLike | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam, as `torch.optim.Adam` (NAdam with `nesterov=True`). State paths: `adam.count`, `adam.mu.*`,
    `adam.nu.*`, `lr.*`."""
    return chain(
        adam=scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov), lr=scale_by_learning_rate(learning_rate)
    )


def adamw(
    learning_rate: ArrayLike | Schedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: DTypeLike | None = None,
    weight_decay: ArrayLike = 1e-4,
    mask: Mask = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdamW: Adam with decoupled weight decay on the leaves `mask` selects (default: all).

    The default weight decay is optax's (1e-4); torch's AdamW defaults to 1e-2 and nanoGPT uses 0.1 on
    `mask=ndim_at_least(2)` (`ndim_at_least(2, stacked=("blocks",))` for stacked blocks). State paths as for
    `adam` (the decay keeps no state)."""
    return chain(
        adam=scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        weight_decay=add_decayed_weights(weight_decay, mask),
        lr=scale_by_learning_rate(learning_rate),
    )
