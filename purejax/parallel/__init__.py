"""Training over several devices with every collective written out in `jax.shard_map`.

- `mesh`: `make_mesh(dp, tp)`, a (data, model) device grid; `parse_mesh("dp=4,tp=2")`; `MeshAxes`, the axes
  a model runs under, which a model's `apply` takes to issue its own collectives.
- `specs`: PartitionSpecs from a table of param-path rules; `shard` to place a tree; `state_specs` for a
  whole training state.
- `data`: `vary`, the one cast whose transpose is data parallelism's gradient all-reduce.
- `fsdp`: ZeRO-3: `fsdp_specs` splits params over the data axis too, `gather` all-gathers them before use.
- `step`: `sharded_train_step`, `purejax.optim.train_step` under `shard_map`.
- `distributed`: `initialize` (jax.distributed from flags or environment), `is_main`, and the global batch
  from the rows each process loads (`local_rows`, `global_batch`).
- `launch`: `python -m purejax.parallel.launch --num_processes=N -- <program>`, N local processes of one run.

docs/parallelism.md draws who holds what in each mode and which collective moves it; docs/multihost.md
says how to run on several processes and hosts.
"""

from purejax.parallel.data import vary
from purejax.parallel.fsdp import fsdp_specs, gather, layer_specs
from purejax.parallel.mesh import DATA, MODEL, MeshAxes, make_mesh, parse_mesh
from purejax.parallel.specs import check_divisible, local_shape, shard, spec_axes, specs_from_rules, state_specs
from purejax.parallel.step import sharded_train_step

__all__ = [
    "DATA",
    "MODEL",
    "MeshAxes",
    "check_divisible",
    "fsdp_specs",
    "gather",
    "layer_specs",
    "local_shape",
    "make_mesh",
    "parse_mesh",
    "shard",
    "sharded_train_step",
    "spec_axes",
    "specs_from_rules",
    "state_specs",
    "vary",
]

from purejax.parallel.distributed import global_batch, initialize, is_main, local_rows, process_count, process_index

__all__ += ["global_batch", "initialize", "is_main", "local_rows", "process_count", "process_index"]
