"""Training over several devices with every collective written out in `jax.shard_map`.

- `mesh`: `make_mesh(dp, tp)`, a (data, model) device grid; `parse_mesh("dp=4,tp=2")`; `MeshAxes`, the axes
  a model runs under (models/gpt_parallel.py takes them to issue its own collectives).
- `specs`: PartitionSpecs from a table of param-path rules; `shard` to place a tree; `state_specs` for a
  whole training state.
- `fsdp`: ZeRO-3: `fsdp_specs` splits params over the data axis too, `gather` all-gathers them before use,
  `gathered` does so inside one layer of a model.
- `sequence`: Megatron sequence parallelism: with tensor parallelism, the layers between its regions on this
  device's slice of the sequence (`gather`, `scatter`, `local_dropout`; `MeshAxes(sequence_parallel=True)`).
- `experts`: expert parallelism: a mixture of experts' experts split over the data axis, tokens sent to
  them and back by `all_to_all` (`to_experts`, `from_experts`; purejax/nn/moe.py, `MeshAxes(ep=True)`).
- `step`: `sharded_train_step`, `purejax.optim.train_step` under `shard_map`, with data parallelism in it:
  each data shard differentiates its own copy of the params, and one `psum` per step sums the gradients.
- `distributed`: `initialize` (jax.distributed under srun, mpirun or our launcher, or from flags or
  environment), `is_main`, and the global batch from the rows each process loads (`local_rows`, `global_batch`).
- `preemption`: a SIGTERM on any process stops every process after the same step (JAX's preemption
  service: `reached_sync_point`, `notify`).
- `cluster`: how a process was started (srun, mpirun, launch), read from its environment before JAX starts.
- `launch`: `python -m purejax.parallel.launch --num_processes=N -- <program>`, N local processes of one run.
- `show`: `describe(tree)`, which device holds which slice of each array, read off the real shardings.

docs/parallelism.md draws who holds what in each mode and which collective moves it; docs/multihost.md
says how to run on several processes and hosts.
"""

from purejax.parallel.fsdp import fsdp_specs, gather, gathered, layer_specs
from purejax.parallel.mesh import CONTEXT, DATA, MODEL, MeshAxes, make_mesh, parse_mesh
from purejax.parallel.show import describe
from purejax.parallel.specs import (
    check_divisible,
    check_shards,
    local_shape,
    shard,
    spec_axes,
    specs_from_rules,
    state_specs,
)
from purejax.parallel.step import sharded_train_step

__all__ = [
    "CONTEXT",
    "DATA",
    "MODEL",
    "MeshAxes",
    "check_divisible",
    "check_shards",
    "describe",
    "fsdp_specs",
    "gather",
    "gathered",
    "layer_specs",
    "local_shape",
    "make_mesh",
    "parse_mesh",
    "shard",
    "sharded_train_step",
    "spec_axes",
    "specs_from_rules",
    "state_specs",
]

from purejax.parallel.distributed import global_batch, initialize, is_main, local_rows, process_count, process_index

__all__ += ["global_batch", "initialize", "is_main", "local_rows", "process_count", "process_index"]
