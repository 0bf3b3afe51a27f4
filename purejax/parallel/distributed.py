"""Multi-process runs: join `jax.distributed` under the launcher that started the processes, say which process
is the main one, and build the global batch from the rows each process loads itself.

One program runs as N processes (one per host, or several on one host); each drives its local devices, and
`jax.devices()` lists the devices of all of them. Every process runs the same program: the same jitted steps,
so the same collectives in the same order. What differs is only

- the data: each process loads just the rows of the global batch that its own devices hold (`local_rows`),
  and `global_batch` assembles them into one `jax.Array` spanning all processes, without copying data
  between processes;
- the side effects: only the main process (`is_main()`) writes logs and progress bars. Checkpoints are
  saved by calling `purejax.checkpoint.save` on every process (it gathers sharded arrays, a collective)
  and only process 0 writes the file.

    from purejax.parallel import distributed

    distributed.initialize()    # first, before any other JAX call; a no-op in a single-process run
    ...
    rows = distributed.local_rows(batch_sharding, (global_batch_size, seq_len))
    batch = distributed.global_batch({"tokens": tokens[rows.start:rows.stop]}, batch_sharding, global_batch_size)

Where the settings come from, first match wins: the arguments of `initialize`; these environment variables
(which `python -m purejax.parallel.launch` sets, and a cluster script may); else the launcher that started the
process, `srun` (Slurm) or `mpirun` (Open MPI), through `jax.distributed.initialize()`'s own detection
(purejax/parallel/cluster.py); else one process.

| variable | meaning |
|---|---|
| `PUREJAX_COORDINATOR` (or JAX's own `JAX_COORDINATOR_ADDRESS`) | `host:port` of process 0, reachable by all |
| `PUREJAX_NUM_PROCESSES` | how many processes take part |
| `PUREJAX_PROCESS_ID` | this process's id, `0 .. N-1` |
| `PUREJAX_INIT_TIMEOUT` | seconds to wait for every process to connect (JAX's default: 300) |
| `PUREJAX_HEARTBEAT_TIMEOUT` | seconds without a heartbeat after which a process counts as dead (20 here; JAX's 100) |
| `PUREJAX_SHUTDOWN_TIMEOUT` | seconds a finishing process waits for the others at exit (default 300) |

See docs/multihost.md for launching, and for what a dead peer looks like.
"""

from typing import Any

import jax
import numpy as np

from purejax.parallel import cluster

# The settings' environment variables and defaults: part of this module's interface, kept in join_settings.
from purejax.parallel.join_settings import DEFAULT_HEARTBEAT_TIMEOUT as DEFAULT_HEARTBEAT_TIMEOUT
from purejax.parallel.join_settings import ENV_COORDINATOR as ENV_COORDINATOR
from purejax.parallel.join_settings import ENV_HEARTBEAT_TIMEOUT as ENV_HEARTBEAT_TIMEOUT
from purejax.parallel.join_settings import ENV_INIT_TIMEOUT as ENV_INIT_TIMEOUT
from purejax.parallel.join_settings import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from purejax.parallel.join_settings import ENV_PROCESS_ID as ENV_PROCESS_ID
from purejax.parallel.join_settings import ENV_SHUTDOWN_TIMEOUT as ENV_SHUTDOWN_TIMEOUT
from purejax.parallel.join_settings import JAX_ENV_COORDINATOR as JAX_ENV_COORDINATOR
from purejax.parallel.join_settings import check_complete, check_same_run, explained, from_launch, setting, timeouts

PyTree = Any


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
    auto_detect: bool | None = None,
) -> None:
    """Join a multi-process JAX run, or do nothing for a single process.

    Must be called before any other JAX call (`jax.devices()`, creating an array, jit): JAX fixes the device
    list when its backend starts, and a backend started by one process alone cannot be joined later.

    Arguments:
        coordinator_address: `host:port` of process 0, where it serves the coordination service. Defaults to
            `$PUREJAX_COORDINATOR`, then `$JAX_COORDINATOR_ADDRESS`.
        num_processes: how many processes take part. Defaults to `$PUREJAX_NUM_PROCESSES`.
        process_id: this process's id in `0 .. num_processes - 1`. Defaults to `$PUREJAX_PROCESS_ID`.
        initialization_timeout: seconds to wait for all processes to connect. Defaults to
            `$PUREJAX_INIT_TIMEOUT`, then JAX's default (300).
        heartbeat_timeout_seconds: a process silent for this long counts as dead, and every other process
            then aborts. Defaults to `$PUREJAX_HEARTBEAT_TIMEOUT`, then `DEFAULT_HEARTBEAT_TIMEOUT` (20).
        shutdown_timeout_seconds: how long a finishing process waits for the others at exit. Defaults to
            `$PUREJAX_SHUTDOWN_TIMEOUT`, then JAX's default (300).
        auto_detect: None (the default) joins the run that `srun` or `mpirun` started, when one started this
            process as one of several, letting `jax.distributed.initialize()` detect what is not given. True
            always hands over to JAX's detection (Cloud TPU pods, Kubernetes: environments only JAX can
            query); False never, so only the settings above count.

    With no settings given and no launcher of several processes found, or with `num_processes == 1`, this is
    a no-op: a single-process program needs no coordinator. Giving only some of the settings outside a
    launch is an error, since a process that silently ran alone would train on a fraction of the data.
    A process started by `python -m purejax.parallel.launch` also starts watching its launcher here, so that
    it ends when the launcher does, even if the launcher is SIGKILLed. JAX's preemption service is switched
    on: from here a SIGTERM goes to its notifier, not to Python (purejax/parallel/preemption.py).
    """
    cluster.die_with_launcher()
    settings = {
        "coordinator_address": setting(coordinator_address, str, ENV_COORDINATOR, JAX_ENV_COORDINATOR),
        "num_processes": setting(num_processes, int, ENV_NUM_PROCESSES),
        "process_id": setting(process_id, int, ENV_PROCESS_ID),
    }
    waits = timeouts(initialization_timeout, heartbeat_timeout_seconds, shutdown_timeout_seconds)
    if jax.distributed.is_initialized():
        check_same_run(settings)
        return
    launch = None if auto_detect is False else cluster.detect()
    if auto_detect is not True:
        if launch is not None and settings["num_processes"] is None and launch.num_processes > 1:
            settings = from_launch(settings, launch)
        elif settings["num_processes"] == 1 or all(value is None for value in settings.values()):
            if settings["process_id"] not in (None, 0):
                raise ValueError(f"initialize: process_id is {settings['process_id']} but num_processes is 1")
            return
        else:
            check_complete(settings)
    jax.config.update("jax_enable_preemption_service", True)  # SIGTERM: every process stops at one step
    try:
        jax.distributed.initialize(**settings, **waits)
    except (RuntimeError, ValueError) as e:  # JAX's own: no coordinator, a port in use, nothing detected
        raise explained(e, settings, launch) from e


def launched_process_count() -> int:
    """How many processes this run will have, known before JAX starts: `$PUREJAX_NUM_PROCESSES`, else the
    count that `srun` or `mpirun` gave (`SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`), else 1. Once `initialize`
    has run, `process_count()` is the count JAX agreed on."""
    given = setting(None, int, ENV_NUM_PROCESSES)
    if given is not None:
        return given
    launch = cluster.detect()
    return launch.num_processes if launch is not None else 1


def process_index() -> int:
    """This process's id, 0 .. process_count() - 1 (0 in a single-process run)."""
    return jax.process_index()


def process_count() -> int:
    """How many processes take part (1 in a single-process run)."""
    return jax.process_count()


def is_main() -> bool:
    """True on process 0 alone: the one that writes logs, progress bars and files.

    Only side effects belong under `if is_main():`; computation never does. A jitted step or a checkpoint
    save called on some processes but not others leaves the rest waiting at a collective forever (or
    until the heartbeat timeout)."""
    return jax.process_index() == 0


def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> range:
    """The rows (indices along axis 0) of a global array of `global_shape` that this process's devices hold
    under `sharding`: the rows this process must load.

    With the batch split over a `data` axis whose devices are laid out process by process (the order of
    `jax.devices()`, which meshes built from it keep), each process owns one contiguous block: with 2
    processes and a global batch of 8, process 0 owns `range(0, 4)` and process 1 `range(4, 8)`. Rows
    replicated over another mesh axis are loaded by every process that holds them.
    """
    global_shape = tuple(global_shape)
    if not global_shape:
        raise ValueError("local_rows: global_shape is (), a scalar has no rows; give the global batch's shape")
    try:
        indices = sharding.addressable_devices_indices_map(global_shape).values()
    except ValueError as e:
        raise ValueError(f"local_rows: a global batch of shape {global_shape} does not fit the sharding: {e}") from None
    blocks = sorted({(index[0].indices(global_shape[0])[:2]) for index in indices})
    start, stop = blocks[0][0], blocks[-1][1]
    if any(a[1] != b[0] for a, b in zip(blocks, blocks[1:])):
        raise ValueError(
            f"local_rows: under {sharding}, process {jax.process_index()} holds the non-contiguous row blocks "
            f"{[range(*b) for b in blocks]} of a global batch of {global_shape[0]}; build the mesh from "
            "jax.devices() in order, so that each process's devices are adjacent along the batch axis"
        )
    return range(start, stop)


def global_batch(local_batch: PyTree, sharding: jax.sharding.Sharding, global_batch_size: int) -> PyTree:
    """One `jax.Array` per leaf of `local_batch`, of `global_batch_size` rows laid out by `sharding`, built
    from the rows this process loaded (`local_rows`); no data crosses between processes.

    Arguments:
        local_batch: a tree of numpy (or jax) arrays, each holding the rows `local_rows(sharding, ...)` of
            its leaf, in order; all axes but the first are whole.
        sharding: how each global leaf is laid out, typically `NamedSharding(mesh, P("data"))`.
        global_batch_size: rows in the global batch, summed over all processes.

    In a single-process run this is `jax.device_put(local_batch, sharding)`, with the same checks.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
    out = []
    for path, x in leaves:
        name = jax.tree_util.keystr(path) or "the batch"
        if np.ndim(x) == 0:
            raise ValueError(f"global_batch: leaf {name} is a scalar; every leaf needs a leading batch axis")
        global_shape = (global_batch_size, *np.shape(x)[1:])
        rows = local_rows(sharding, global_shape)
        if np.shape(x)[0] != len(rows):
            raise ValueError(
                f"global_batch: leaf {name} has {np.shape(x)[0]} rows (shape {np.shape(x)}), but process "
                f"{jax.process_index()} of {jax.process_count()} owns rows {rows.start}..{rows.stop} "
                f"({len(rows)} rows) of the global batch of {global_batch_size} under {sharding}; load exactly "
                "local_rows(sharding, global_shape) on each process"
            )
        out.append(jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape))
    return jax.tree_util.tree_unflatten(treedef, out)
