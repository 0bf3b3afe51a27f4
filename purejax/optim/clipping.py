"""Gradient clipping: by global norm (Pascanu et al. 2013), by value, and by per-leaf RMS (Adafactor).

`clip_by_global_norm(max_norm)` rescales the whole gradient tree by `max_norm / norm` when its norm exceeds
`max_norm`, as `optax.clip_by_global_norm` does (to float rounding). torch's `clip_grad_norm_` divides by
`norm + 1e-6` instead of `norm`: a relative difference below 1e-6 whenever the norm is above 1. The
pre-clipping norm is kept in the state (`GlobalNormState.global_norm`) so a training loop can log it without
computing it again.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from purejax import tree as tree_lib
from purejax.optim.base import GradientTransformation, PyTree, stateless


class GlobalNormState(NamedTuple):
    """The global norm of the gradients the last update saw, before clipping."""

    global_norm: Float[Array, ""]


def clip_to_norm(tree: PyTree, norm: Float[Array, ""], max_norm: ArrayLike) -> PyTree:
    """`tree` rescaled to norm `max_norm` if its (already computed) `norm` is not below it; else unchanged.

    Every leaf is multiplied by one scalar, `min(1, max_norm / norm)` (torch's form; optax computes
    `t / norm * max_norm`, equal to rounding). A scalar factor is cheap enough for XLA to fuse into each
    consumer, so the clipped gradients are never materialised: one parameter-sized buffer less than
    `optax.clip_by_global_norm` in a jitted AdamW step (bench/optim.py)."""
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree_util.tree_map(lambda t: t * factor.astype(t.dtype), tree)


def clip_by_global_norm(max_norm: ArrayLike, axis_name: Any = None, *, specs: PyTree = None) -> GradientTransformation:
    """Scale updates down so that their global L2 norm is at most `max_norm`.

    Arguments:
        max_norm: the largest global norm let through (nanoGPT: 1.0).
        axis_name: inside `shard_map`, the mesh axes every leaf is sharded over; or
        specs: the `PartitionSpec` of each leaf (the params' specs), when leaves are sharded differently. The
            norm is then the norm of the whole, unsharded tree on every device (see `purejax.tree.global_norm`).
    """

    def init(params: PyTree) -> GlobalNormState:
        del params
        return GlobalNormState(jnp.zeros((), jnp.float32))

    def update(updates: PyTree, state: GlobalNormState, params: PyTree = None) -> tuple[PyTree, GlobalNormState]:
        del params
        norm = tree_lib.global_norm(updates, axis_name, specs=specs)
        return clip_to_norm(updates, norm, max_norm), GlobalNormState(norm)

    return GradientTransformation(init, update)


def clip(max_delta: ArrayLike) -> GradientTransformation:
    """Clip every element into `[-max_delta, max_delta]` (torch's `clip_grad_value_`, `optax.clip`)."""
    return stateless(
        lambda updates, params: jax.tree_util.tree_map(lambda u: jnp.clip(u, -max_delta, max_delta), updates)
    )


def clip_by_block_rms(threshold: ArrayLike) -> GradientTransformation:
    """Scale each leaf down so that its root-mean-square is at most `threshold` (Adafactor's update clipping,
    Shazeer & Stern 2018, section 6)."""

    def clip_leaf(u: Array) -> Array:
        return u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(jnp.square(u))) / threshold)

    return stateless(lambda updates, params: jax.tree_util.tree_map(clip_leaf, updates))
