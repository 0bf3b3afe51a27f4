"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolated momentum.

    update = sign((1 - b1) * g + b1 * mu)        mu = b2 * mu + (1 - b2) * g

Every update element is +-1 before the learning rate, so Lion wants a learning rate 3-10x smaller than AdamW's
and a weight decay 3-10x larger. One parameter-sized buffer instead of Adam's two.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Int

from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain, safe_increment, zero_count
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.weight_decay import Mask, add_decayed_weights


class LionState(NamedTuple):
    """Steps taken, and the momentum `mu`, one array per parameter."""

    count: Int[Array, ""]
    mu: PyTree


def scale_by_lion(
    b1: ArrayLike = 0.9, b2: ArrayLike = 0.99, mu_dtype: DTypeLike | None = None
) -> GradientTransformation:
    """Replace updates by Lion's sign update (no learning rate, no sign flip).

    Arguments:
        b1: interpolation between the gradient and the momentum for the update.
        b2: decay rate of the momentum kept in the state.
        mu_dtype: dtype of the momentum; default: each parameter's dtype.
    """

    def init(params: PyTree) -> LionState:
        return LionState(zero_count(), jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params))

    def update(updates: PyTree, state: LionState, params: PyTree = None) -> tuple[PyTree, LionState]:
        del params
        signs = jax.tree_util.tree_map(lambda g, m: jnp.sign((1 - b1) * g + b1 * m), updates, state.mu)
        mu = jax.tree_util.tree_map(lambda g, m: ((1 - b2) * g + b2 * m).astype(m.dtype), updates, state.mu)
        return signs, LionState(safe_increment(state.count), mu)

    return GradientTransformation(init, update)


def lion(
    learning_rate: ArrayLike | Schedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.99,
    mu_dtype: DTypeLike | None = None,
    weight_decay: ArrayLike = 1e-3,
    mask: Mask = None,
) -> GradientTransformation:
    """Lion with decoupled weight decay on the leaves `mask` selects. State paths: `lion.mu.*`, `lr.*`."""
    return chain(
        lion=scale_by_lion(b1, b2, mu_dtype),
        weight_decay=add_decayed_weights(weight_decay, mask),
        lr=scale_by_learning_rate(learning_rate),
    )
