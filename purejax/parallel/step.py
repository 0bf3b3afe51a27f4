"""A training step over a device mesh: `purejax.optim.train_step`, run by `jax.shard_map`.

    mesh = make_mesh(dp=4, tp=2)
    specs = state_specs(state, param_specs)                  # a PartitionSpec for every leaf of the state
    state = shard(state, specs, mesh)                        # each device gets its slices
    step = sharded_train_step(mesh, specs, P("data"), loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0)
    state, metrics = step(state, batch)                      # batch: a global array, split over "data"

Inside `shard_map` every function sees only its device's slices, and every collective is written out by the
code that needs it: the model's tensor-parallel `psum`s, the FSDP `all_gather`s, the loss's `psum` over the
data axis. None is written for the gradients. Why that is right:

    loss = psum(local sum over tokens, data) / psum(local count, data)      # the whole batch's mean
    params are replicated over data (the same on every device) and the batch is not, so wherever a param
    meets a batch-dependent value, it is cast to varying over data (`jax.lax.pcast(..., to="varying")`, a
    no-op on the values, which `check_vma=True` requires); under jax.grad, the transpose of that cast is a
    psum over data.

So `jax.grad` of the averaged loss returns, on every device, the sum over shards of each shard's share of
the whole-batch gradient: the gradient one device would compute from the whole batch, with one all-reduce
per parameter, placed by JAX. Averaging those gradients again (the habit from `pmap` code, jax#3970) would be
wrong twice over: differentiating a per-shard mean and then `pmean`-ing the gradients gives D times the true
gradient on D data shards, because the implicit psum has already summed them. The tests check both.

What the optimizer must know is which axes each gradient is split over, so that the global norm (logging,
clipping, the loss-scale finiteness check) sums each leaf's squares over its own axes and no others:
`sharded_train_step` passes the params' specs to `train_step` as `param_specs`.
"""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from purejax.optim.train_step import TrainState, train_step

PyTree = Any


def sharded_train_step(
    mesh: jax.sharding.Mesh, state_specs: TrainState, batch_specs: PyTree, **train_step_kwargs: Any
) -> Any:
    """`train_step` under `jax.jit(jax.shard_map(...))` over `mesh`: `step(state, batch) -> (state, metrics)`.

    Arguments:
        state_specs: a TrainState of PartitionSpecs (`state_specs(state, param_specs)`); the state must be
            placed that way (`shard`) and comes back the same way. It is donated: the old state's buffers
            are reused for the new one.
        batch_specs: how the batch is split, e.g. `P("data")` for every leaf split over "data" on its
            leading axis (a spec for the whole batch tree, or a tree of specs).
        train_step_kwargs: `loss_fn`, `optimizer`, `max_grad_norm`, `ema`, `micro_batches` as for
            `train_step`. `loss_fn` must return a loss averaged over the data axis and metrics that are the
            same on every device (reduce them over the data axis too); `check_vma` rejects any that are not.
    """
    if "param_specs" in train_step_kwargs or "axis_name" in train_step_kwargs:
        raise ValueError("sharded_train_step: the norm's axes come from state_specs.params; drop param_specs/axis_name")

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        return train_step(state, batch, param_specs=state_specs.params, **train_step_kwargs)

    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(state_specs, batch_specs), out_specs=(state_specs, P()), check_vma=True
    )
    return jax.jit(sharded, donate_argnums=0)
