"""A training step over a device mesh: `purejax.optim.train_step` run by `jax.shard_map`, with data
parallelism's one gradient all-reduce written here.

    mesh = make_mesh(dp=4, tp=2)
    specs = state_specs(state, param_specs)                  # a PartitionSpec for every leaf of the state
    state = shard(state, specs, mesh)                        # each device gets its slices
    step = sharded_train_step(mesh, specs, P("data"), loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0)
    state, metrics = step(state, batch)                      # batch: a global array, split over "data"

Inside `shard_map` every function sees only its device's slices, and every collective is written by the code
that needs it: the model's tensor-parallel `psum`s, FSDP's `all_gather`s, the loss's `psum` of its sum and
count over the data axis, and here, data parallelism's gradient all-reduce. The data axes are those the
batch is split over (`batch_specs`). What each data shard does in one step:

    local = pcast(params, data, to="varying")   # its own copy of the params it holds whole (values unchanged)
    key = fold_in(key, axis_index(data))         # its own dropout masks: its rows are other examples
    grads = sum over its micro-batches of grad(loss_fn)(local, micro_batch, key_i)   # no communication
    grads = psum(grads, data)                    # the one all-reduce of the step
    the update, identical on every shard (the params and optimizer state stay replicated)

Why a copy. Under `check_vma=True` replicated params are typed invariant over `data` and the batch varying.
Had `loss_fn` received the params themselves, JAX would cast each to varying where it meets the batch, and
under `jax.grad` the transpose of that cast is a `psum`: an all-reduce per use, per micro-batch, as DDP
without `no_sync`. Differentiating the shard's own copy keeps its gradient local until the sum, once per step
whatever `micro_batches` (tests/purejax/parallel count the all-reduces in the compiled program).

Why a sum. `loss_fn` returns the whole batch's mean, `psum(sum of token losses) / psum(token count)`
(`losses.masked_mean(..., axis_name=data)`), so a shard with more ignored tokens weighs less, as on one
device. Its gradient with respect to a shard's copy is that shard's share of the whole batch's gradient, and
the shares sum to it: nothing is divided afterwards. (The pmap-era habit, the gradient of each shard's own
mean then `pmean`, is right only when every shard counts as many tokens.) The loss needs no reduction
either; other metrics `loss_fn` returns must be the same on every device (reduced over the data axis too).

FSDP (ZeRO-3). A param split over the data axis is already each shard's own: it gets no copy and no `psum`.
The model all-gathers it before use, and `jax.grad` transposes each all-gather into a reduce-scatter of its
gradient, inside every micro-batch: ZeRO-3's trade of k reduce-scatters per step for never holding a whole
gradient (docs/parallelism.md). Replicated leaves under FSDP (biases, LayerNorms) are summed once, as above.

The optimizer's global norm (logging, clipping, the loss-scale check) sums each leaf's squares over the axes
that leaf is split on: `sharded_train_step` passes the params' specs to `train_step` as `param_specs`.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from purejax.optim.train_step import TrainState, train_step
from purejax.parallel.specs import spec_axes

PyTree = Any


def sharded_train_step(
    mesh: jax.sharding.Mesh,
    state_specs: TrainState,
    batch_specs: PyTree,
    *,
    loss_fn: Callable,
    **train_step_kwargs: Any,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, Any]]]:
    """`train_step` under `jax.jit(jax.shard_map(...))` over `mesh`: `step(state, batch) -> (state, metrics)`.

    Arguments:
        state_specs: a TrainState of PartitionSpecs (`state_specs(state, param_specs)`); the state must be
            placed that way (`shard`) and comes back the same way. It is donated: the old state's buffers
            are reused for the new one.
        batch_specs: how the batch is split, e.g. `P("data")` for every leaf split over "data" on its
            leading axis (a spec for the whole batch tree, or a tree of specs). The axes named here are the
            data-parallel ones; `P()` (a 1 x tp mesh) has none.
        loss_fn: as for `train_step`, and it must return the loss averaged over the whole batch (over the
            data axes) and metrics that are the same on every device; `check_vma` rejects any that are not.
        train_step_kwargs: `optimizer`, `max_grad_norm`, `ema`, `micro_batches` as for `train_step`.
    """
    taken = sorted({"param_specs", "axis_name", "grad_reduce", "local_params"} & set(train_step_kwargs))
    if taken:
        raise ValueError(f"sharded_train_step sets {taken} itself (from state_specs and batch_specs); drop them")
    data = batch_axes(batch_specs)
    specs = state_specs.params

    def sum_over_shards(grads: PyTree) -> PyTree:  # the one data-parallel all-reduce of the step
        return jax.tree.map(lambda g, s: g if _split(s, data) else jax.lax.psum(g, data), grads, specs)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        if not data:  # the whole batch on every device: nothing to copy, sum or fold
            return train_step(state, batch, loss_fn=loss_fn, param_specs=specs, **train_step_kwargs)
        return train_step(
            state,
            batch,
            loss_fn=with_shard_key(loss_fn, data),
            local_params=lambda params: local_copy(params, specs, data),
            grad_reduce=sum_over_shards,
            param_specs=specs,
            **train_step_kwargs,
        )

    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(state_specs, batch_specs), out_specs=(state_specs, P()), check_vma=True
    )
    return jax.jit(sharded, donate_argnums=0)


def batch_axes(batch_specs: PyTree) -> tuple[str, ...]:
    """The mesh axes any leaf of the batch is split over, in order of first appearance: the data axes."""
    leaves = jax.tree.leaves(batch_specs, is_leaf=lambda x: isinstance(x, P))
    return tuple(dict.fromkeys(axis for spec in leaves for axis in spec_axes(spec)))


def local_copy(params: PyTree, specs: PyTree, data: tuple[str, ...]) -> PyTree:
    """Inside `shard_map`: each param this device holds whole over the `data` axes, cast to varying over them
    (`jax.lax.pcast(..., to="varying")`, no change to the values), so that `jax.grad` keeps this shard's
    gradient of it local; params split over a data axis (FSDP) are the shard's own already."""
    return jax.tree.map(lambda p, s: p if _split(s, data) else jax.lax.pcast(p, data, to="varying"), params, specs)


def with_shard_key(loss_fn: Callable, data: tuple[str, ...]) -> Callable:
    """`loss_fn` called with its key (the last argument) folded with this device's index over the `data`
    axes: each data shard draws its own dropout masks, the devices of one shard (tensor parallelism) the same."""
    index = data[0] if len(data) == 1 else data

    def loss_fn_with_shard_key(*args: Any) -> Any:
        *rest, key = args
        return loss_fn(*rest, jax.random.fold_in(key, jax.lax.axis_index(index)))

    return loss_fn_with_shard_key


def _split(spec: P, data: tuple[str, ...]) -> bool:
    return any(axis in data for axis in spec_axes(spec))
