"""Gradient accumulation over k micro-batches, two ways.

`accumulate_gradients` runs inside one jitted step: it splits the batch into k micro-batches and `lax.scan`s
over them, so only one micro-batch's activations are alive at a time. The running sum of gradients is a
temporary of the step; nothing parameter-sized is added to the optimizer state. Prefer it.

`multi_steps(optimizer, k)` is for loops that feed one micro-batch per call (as `optax.MultiSteps`): it keeps
the running mean of the gradients in its state (one extra parameter-sized buffer, which is what makes
MultiSteps run out of memory on large models) and applies the wrapped optimizer every k-th call, returning
zero updates in between.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from purejax import tree as tree_lib
from purejax.optim.base import GradientTransformation, PyTree, extra_args_for, safe_increment, zero_count


def split_micro_batches(batch: PyTree, micro_batches: int) -> PyTree:
    """Every leaf `[batch, ...]` reshaped to `[micro_batches, batch // micro_batches, ...]`: micro-batch i holds
    consecutive examples. Raises ValueError naming every leaf whose leading size is not divisible."""
    flat = tree_lib.flatten(batch)
    bad = [f"{path}: {tree_lib.describe(x)}" for path, x in flat.items() if x.ndim == 0 or x.shape[0] % micro_batches]
    if bad:
        raise ValueError(
            f"cannot split the batch into {micro_batches} micro-batches: the leading axis of these leaves is not "
            f"a multiple of {micro_batches}: {', '.join(bad)}"
        )
    return jax.tree_util.tree_map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)


def accumulate_gradients(
    grad_fn: Callable[[PyTree, PyTree, PRNGKeyArray], tuple[PyTree, PyTree]],
    params: PyTree,
    batch: PyTree,
    key: PRNGKeyArray,
    micro_batches: int = 1,
) -> tuple[PyTree, PyTree]:
    """The mean over micro-batches of `grad_fn(params, micro_batch, key) -> (grads, aux)`, and of its `aux`.

    With equal-sized micro-batches and a loss that is a mean over examples, this is the gradient of the loss on
    the whole batch (up to float rounding). Each micro-batch gets its own key, split from `key`. Gradients are
    summed in float32 (at least) and returned in the params' dtypes. Floating `aux` leaves are averaged the
    same way; integer and bool leaves have no mean in their own dtype and are the last micro-batch's, so that
    `aux` has the same dtypes whatever `micro_batches` is.
    """
    if micro_batches == 1:
        return grad_fn(params, batch, key)
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches}")
    stacked = split_micro_batches(batch, micro_batches)
    # zeros_like, not zeros(p.shape): inside shard_map it keeps the mesh axes p varies over (a sharded param)
    total = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params)

    def body(total: PyTree, xs: tuple[PyTree, PRNGKeyArray]) -> tuple[PyTree, PyTree]:
        grads, aux = grad_fn(params, *xs)
        return jax.tree_util.tree_map(lambda t, g: t + g, total, grads), aux

    total, auxes = jax.lax.scan(body, total, (stacked, jax.random.split(key, micro_batches)))
    grads = jax.tree_util.tree_map(lambda t, p: (t / micro_batches).astype(p.dtype), total, params)
    return grads, jax.tree_util.tree_map(_mean_or_last, auxes)


def _mean_or_last(stacked: Array) -> Array:
    """The mean over the leading (micro-batch) axis, in float32 at least, for a floating array; else the last."""
    if not jnp.issubdtype(stacked.dtype, jnp.floating):
        return stacked[-1]
    return jnp.mean(stacked.astype(jnp.promote_types(stacked.dtype, jnp.float32)), axis=0).astype(stacked.dtype)


class MultiStepsState(NamedTuple):
    """Micro-batches seen in this cycle (0 .. k-1), optimizer updates made, the wrapped optimizer's state, and
    the running mean of this cycle's gradients (float32, the params' structure)."""

    mini_step: Int[Array, ""]
    gradient_step: Int[Array, ""]
    inner: PyTree
    grads: PyTree


def multi_steps(optimizer: Any, every_k: int) -> GradientTransformation:
    """`optimizer` applied to the mean gradient of every `every_k` consecutive calls; zero updates between.

    The same updates as `optax.MultiSteps(optimizer, every_k).gradient_transformation()`, but the wrapped
    optimizer only runs on the k-th call (`lax.cond`) instead of on every call. Extra keyword arguments of
    `update` (`value=`) go to the wrapped optimizer on that call, as `chain` passes them."""
    if every_k < 1:
        raise ValueError(f"multi_steps: every_k must be a positive integer, got {every_k}")

    def init(params: PyTree) -> MultiStepsState:
        grads = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return MultiStepsState(zero_count(), zero_count(), optimizer.init(params), grads)

    def update(
        updates: PyTree, state: MultiStepsState, params: PyTree = None, **extra_args: Any
    ) -> tuple[PyTree, MultiStepsState]:
        # A running mean, `mean + (g - mean) / n`, as optax keeps it: the sum of k large gradients may overflow.
        mean = jax.tree_util.tree_map(lambda g, m: m + (g - m) / (state.mini_step + 1), updates, state.grads)
        emit = state.mini_step == every_k - 1

        def apply(mean: PyTree) -> tuple[PyTree, PyTree]:
            grads = jax.tree_util.tree_map(lambda m, g: m.astype(g.dtype), mean, updates)
            return optimizer.update(grads, state.inner, params, **extra_args_for(optimizer.update, extra_args))

        def wait(mean: PyTree) -> tuple[PyTree, PyTree]:
            shapes = jax.eval_shape(apply, mean)[0]
            return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state.inner

        new_updates, inner = jax.lax.cond(emit, apply, wait, mean)
        return new_updates, MultiStepsState(
            mini_step=safe_increment(state.mini_step) % every_k,
            gradient_step=jnp.where(emit, safe_increment(state.gradient_step), state.gradient_step),
            inner=inner,
            grads=jax.tree_util.tree_map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), mean),
        )

    return GradientTransformation(init, update)
