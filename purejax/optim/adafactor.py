"""Adafactor (Shazeer & Stern 2018): Adam-like scaling with second moments stored as row and column averages.

For a matrix gradient g of shape (n, m) Adafactor keeps `row` (n,) and `col` (m,), running means of `g**2 + eps`
over the columns and over the rows, and estimates the full second moment as `outer(row, col) / mean(row)`:
O(n + m) memory instead of Adam's O(n * m). Leaves with fewer than two dimensions of at least
`min_dim_size_to_factor` keep an unfactored average `v` of their own shape. The averaging weight grows with the
step t: `decay_t = 1 - t**-decay_rate` (section 7.2 of the paper).

`adafactor` then clips each leaf's update to RMS 1, scales it by the learning rate and by the RMS of the
parameter itself (relative step size), and descends; the same steps and defaults as `optax.adafactor`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Int

from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain, safe_increment, stateless, zero_count
from purejax.optim.clipping import clip_by_block_rms
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.weight_decay import Mask, add_decayed_weights


class Factored(NamedTuple):
    """Second-moment statistics of one factored leaf. For a matrix (n, m): `row` (n,) is the running mean of
    `g**2 + eps` along each row, `col` (m,) along each column. For more dimensions the same with the two
    factored axes: `row` averages over the later one, `col` over the earlier one."""

    row: Array
    col: Array


class Unfactored(NamedTuple):
    """Second-moment statistics of a leaf too small to factor: a full running average."""

    v: Array


class FactoredRmsState(NamedTuple):
    """Steps taken, and per parameter its `Factored` or `Unfactored` statistics."""

    count: Int[Array, ""]
    stats: PyTree


def factored_axes(shape: tuple[int, ...], min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """(second largest axis, largest axis) of `shape` if the second largest is at least `min_dim_size_to_factor`
    long; else None (the leaf is not factored). Ties are broken as numpy's argsort breaks them."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return int(order[-2]), int(order[-1])


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: ArrayLike = 0.8,
    step_offset: ArrayLike = 0,
    min_dim_size_to_factor: int = 128,
    eps: ArrayLike = 1e-30,
) -> GradientTransformation:
    """Divide updates by Adafactor's (factored) estimate of the root-mean-square gradient.

    Arguments:
        factored: factor the second moments of large enough leaves (False: keep full averages everywhere).
        decay_rate: exponent of the step-dependent decay `1 - t**-decay_rate`.
        step_offset: subtracted from the step count, e.g. the first step of a fine-tuning run.
        min_dim_size_to_factor: a leaf is factored only if two of its axes are at least this long.
        eps: added to the squared gradients before averaging (the paper's epsilon_1).
    """

    def axes(shape: tuple[int, ...]) -> tuple[int, int] | None:
        return factored_axes(shape, min_dim_size_to_factor) if factored else None

    def init_leaf(p: Array) -> Factored | Unfactored:
        found = axes(p.shape)
        if found is None:
            return Unfactored(jnp.zeros_like(p))
        first, last = sorted(found)
        return Factored(jnp.zeros_like(p.sum(axis=last)), jnp.zeros_like(p.sum(axis=first)))

    def update_leaf(g: Array, stats: Factored | Unfactored, decay: Array) -> tuple[Array, Factored | Unfactored]:
        g_sq = jnp.square(g) + eps
        if isinstance(stats, Unfactored):
            v = (decay * stats.v + (1.0 - decay) * g_sq).astype(stats.v.dtype)
            return g * v**-0.5, Unfactored(v)
        second, largest = axes(g.shape)
        first, last = sorted((second, largest))
        row = (decay * stats.row + (1.0 - decay) * jnp.mean(g_sq, axis=last)).astype(stats.row.dtype)
        col = (decay * stats.col + (1.0 - decay) * jnp.mean(g_sq, axis=first)).astype(stats.col.dtype)
        # v_hat = outer(row, col) / mean(g**2). Normalise by the mean of the statistic averaged over the largest
        # axis, as optax does (the two means agree up to rounding).
        over_largest, over_second = (row, col) if largest == last else (col, row)
        kept = second if second < largest else second - 1  # where `second` sits once `largest` is averaged out
        largest_factor = (over_largest / jnp.mean(over_largest, axis=kept, keepdims=True)) ** -0.5
        update = g * jnp.expand_dims(largest_factor, axis=largest) * jnp.expand_dims(over_second**-0.5, axis=second)
        return update, Factored(row, col)

    def init(params: PyTree) -> FactoredRmsState:
        return FactoredRmsState(zero_count(), jax.tree_util.tree_map(init_leaf, params))

    def update(updates: PyTree, state: FactoredRmsState, params: PyTree = None) -> tuple[PyTree, FactoredRmsState]:
        del params
        t = jnp.asarray(state.count - step_offset + 1, jnp.float32)
        decay = 1.0 - t ** (-decay_rate)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        results = [update_leaf(g, s, decay) for g, s in zip(leaves, treedef.flatten_up_to(state.stats))]
        new_updates = treedef.unflatten([u for u, _ in results])
        new_stats = treedef.unflatten([s for _, s in results])
        return new_updates, FactoredRmsState(safe_increment(state.count), new_stats)

    return GradientTransformation(init, update)


def scale_by_param_block_rms(min_scale: ArrayLike = 1e-3) -> GradientTransformation:
    """Multiply each leaf's update by the RMS of the parameter itself, at least `min_scale` (Adafactor's
    relative step size: a parameter moves by a fraction of its own scale)."""

    def scale(updates: PyTree, params: PyTree) -> PyTree:
        if params is None:
            raise ValueError("scale_by_param_block_rms needs the params: call update(grads, state, params)")
        rms = lambda p: jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(p))), min_scale)  # noqa: E731
        return jax.tree_util.tree_map(lambda u, p: u * rms(p), updates, params)

    return stateless(scale)


class MomentumState(NamedTuple):
    """A running average of the updates (not debiased), as Adafactor's optional momentum keeps it."""

    mu: PyTree


def _momentum(decay: ArrayLike, dtype: DTypeLike) -> GradientTransformation:
    def init(params: PyTree) -> MomentumState:
        return MomentumState(jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=dtype), params))

    def update(updates: PyTree, state: MomentumState, params: PyTree = None) -> tuple[PyTree, MomentumState]:
        del params
        mu = jax.tree_util.tree_map(lambda u, m: (1 - decay) * u + decay * m, updates, state.mu)
        return mu, MomentumState(jax.tree_util.tree_map(lambda m: m.astype(dtype), mu))

    return GradientTransformation(init, update)


def adafactor(
    learning_rate: ArrayLike | Schedule,
    min_dim_size_to_factor: int = 128,
    decay_rate: ArrayLike = 0.8,
    decay_offset: ArrayLike = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: ArrayLike | None = 1.0,
    momentum: ArrayLike | None = None,
    dtype_momentum: DTypeLike = jnp.float32,
    weight_decay_rate: ArrayLike | None = None,
    eps: ArrayLike = 1e-30,
    factored: bool = True,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """Adafactor with optax's defaults. State paths: `factored_rms.stats.<param path>.row|col|v`, and
    `momentum.mu.*` if momentum is on. The weight decay (if any) is added after the learning rate, unscaled by
    it, as in optax."""
    parts = {"factored_rms": scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)}
    if clipping_threshold is not None:
        parts["clip"] = clip_by_block_rms(clipping_threshold)
    parts["lr"] = scale_by_learning_rate(learning_rate, flip_sign=False)
    if multiply_by_parameter_scale:
        parts["param_scale"] = scale_by_param_block_rms()
    if momentum is not None:
        parts["momentum"] = _momentum(momentum, dtype_momentum)
    if weight_decay_rate is not None:
        parts["weight_decay"] = add_decayed_weights(weight_decay_rate, weight_decay_mask)
    parts["descent"] = stateless(lambda updates, params: jax.tree_util.tree_map(jnp.negative, updates))
    return chain(**parts)
