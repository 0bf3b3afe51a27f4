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

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from purejax.parallel import cluster

ENV_COORDINATOR = "PUREJAX_COORDINATOR"
ENV_NUM_PROCESSES = "PUREJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PUREJAX_PROCESS_ID"
ENV_INIT_TIMEOUT = "PUREJAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "PUREJAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "PUREJAX_SHUTDOWN_TIMEOUT"
JAX_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed.initialize itself
# JAX declares a process dead after 100 s of silence; a survivor then waits that long in its next collective.
# Heartbeats come from a thread of JAX's runtime, not from Python, so a long compile or step does not delay
# them: 20 s only has to outlast a network hiccup, and it ends a run with a dead peer within the launcher's
# 30 s failure grace.
DEFAULT_HEARTBEAT_TIMEOUT = 20

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
        "coordinator_address": _setting(coordinator_address, str, ENV_COORDINATOR, JAX_ENV_COORDINATOR),
        "num_processes": _setting(num_processes, int, ENV_NUM_PROCESSES),
        "process_id": _setting(process_id, int, ENV_PROCESS_ID),
    }
    timeouts = _timeouts(initialization_timeout, heartbeat_timeout_seconds, shutdown_timeout_seconds)
    if jax.distributed.is_initialized():
        _check_same_run(settings)
        return
    launch = None if auto_detect is False else cluster.detect()
    if auto_detect is not True:
        if launch is not None and settings["num_processes"] is None and launch.num_processes > 1:
            settings = _from_launch(settings, launch)
        elif settings["num_processes"] == 1 or all(value is None for value in settings.values()):
            if settings["process_id"] not in (None, 0):
                raise ValueError(f"initialize: process_id is {settings['process_id']} but num_processes is 1")
            return
        else:
            _check_complete(settings)
    jax.config.update("jax_enable_preemption_service", True)  # SIGTERM: every process stops at one step
    try:
        jax.distributed.initialize(**settings, **timeouts)
    except (RuntimeError, ValueError) as e:  # JAX's own: no coordinator, a port in use, nothing detected
        raise _explained(e, settings, launch) from e


def launched_process_count() -> int:
    """How many processes this run will have, known before JAX starts: `$PUREJAX_NUM_PROCESSES`, else the
    count that `srun` or `mpirun` gave (`SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`), else 1. Once `initialize`
    has run, `process_count()` is the count JAX agreed on."""
    given = _setting(None, int, ENV_NUM_PROCESSES)
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


def _setting(value: Any, kind: type, *env_names: str) -> Any:
    """`value` if given, else the first of `env_names` set in the environment, parsed as `kind`, else None."""
    if value is not None:
        return value
    for env in env_names:
        if raw := os.environ.get(env, "").strip():
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"initialize: ${env} is {raw!r}, which is not an {kind.__name__}") from None
    return None


def _from_launch(settings: dict[str, Any], launch: cluster.Launch) -> dict[str, Any]:
    """The settings for a run that `srun` or `mpirun` started. Where JAX's detection reads everything itself,
    what was not given stays None for it to fill in; Open MPI 5 names no coordinator that JAX can read, so
    the counts are passed on and the coordinator must be given."""
    if launch.jax_detects:
        return settings
    if settings["coordinator_address"] is None:
        raise ValueError(
            f"initialize: this is process {launch.process_id} of {launch.num_processes} started by "
            f"{launch.launcher}, but JAX finds the coordinator only through ${cluster.OPEN_MPI_URI}, which this "
            f"Open MPI (version 5 or later) does not set; give ${ENV_COORDINATOR}=<host of rank 0>:<free port> to "
            "every process (mpirun -x), or coordinator_address"
        )
    return {**settings, "num_processes": launch.num_processes, "process_id": launch.process_id}


def _explained(error: Exception, settings: Mapping[str, Any], launch: cluster.Launch | None) -> Exception:
    """JAX's error from `jax.distributed.initialize`, prefixed with who this process is and how it was started."""
    who, count = settings["process_id"], settings["num_processes"]
    if launch is not None:
        who, count = (launch.process_id if who is None else who), (launch.num_processes if count is None else count)
    how = f" started by {launch.launcher}" if launch else ""
    first = "must be called before" in str(error)
    hint = (
        (
            " Call purejax.parallel.initialize() first in your program, before anything (including code run at "
            "import time) creates an array or asks for devices."
        )
        if first
        else ""
    )
    message = f"initialize(process {who} of {count}{how}, coordinator {settings['coordinator_address']}): {error}{hint}"
    return (ValueError if isinstance(error, ValueError) else RuntimeError)(message)


def _timeouts(initialization: int | None, heartbeat: int | None, shutdown: int | None) -> dict[str, int]:
    """The timeouts given or set in the environment; JAX's defaults for the rest, except the heartbeat's."""
    heartbeat = _setting(heartbeat, int, ENV_HEARTBEAT_TIMEOUT)
    timeouts = {
        "initialization_timeout": _setting(initialization, int, ENV_INIT_TIMEOUT),
        "heartbeat_timeout_seconds": DEFAULT_HEARTBEAT_TIMEOUT if heartbeat is None else heartbeat,
        "shutdown_timeout_seconds": _setting(shutdown, int, ENV_SHUTDOWN_TIMEOUT),
    }
    return {name: value for name, value in timeouts.items() if value is not None}


def _check_complete(settings: Mapping[str, Any]) -> None:
    env = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES, "process_id": ENV_PROCESS_ID}
    missing = [f"{name} (or ${env[name]})" for name, value in settings.items() if value is None]
    if missing:
        given = {name: value for name, value in settings.items() if value is not None}
        raise ValueError(
            f"initialize: a multi-process run needs coordinator_address, num_processes and process_id, but only "
            f"{given} were given; also set {', '.join(missing)}, or none of them for a single-process run, or "
            "start the processes with srun or mpirun, or pass auto_detect=True where JAX can read them from the "
            "cluster (Cloud TPU pod, Kubernetes)"
        )
    n, i = settings["num_processes"], settings["process_id"]
    if not 0 <= i < n:
        raise ValueError(f"initialize: process_id must be in 0..{n - 1} for num_processes={n}, got {i}")


def _check_same_run(settings: Mapping[str, Any]) -> None:
    """A second call is fine if it describes the run already joined (a program and a library may both call)."""
    now = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
    clash = {name: (settings[name], value) for name, value in now.items() if settings[name] not in (None, value)}
    if clash:
        raise RuntimeError(
            f"initialize: jax.distributed is already initialised as process {now['process_id']} of "
            f"{now['num_processes']}, which differs from {clash} (given, running); it can be initialised once"
        )
