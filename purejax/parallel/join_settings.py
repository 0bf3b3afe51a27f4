"""Where `purejax.parallel.initialize` finds its settings and how it explains a failure to join: arguments
first, then the `PUREJAX_*` environment variables, then the launcher (`srun`, `mpirun`) that started the
process; the checks that a run's settings are complete and that a second call describes the same run.
(purejax/parallel/distributed.py's docstring has the table of variables.)"""

import os
from collections.abc import Mapping
from typing import Any

import jax

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


def setting(value: Any, kind: type, *env_names: str) -> Any:
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


def from_launch(settings: dict[str, Any], launch: cluster.Launch) -> dict[str, Any]:
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


def explained(error: Exception, settings: Mapping[str, Any], launch: cluster.Launch | None) -> Exception:
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


def timeouts(initialization: int | None, heartbeat: int | None, shutdown: int | None) -> dict[str, int]:
    """The timeouts given or set in the environment; JAX's defaults for the rest, except the heartbeat's."""
    heartbeat = setting(heartbeat, int, ENV_HEARTBEAT_TIMEOUT)
    timeouts = {
        "initialization_timeout": setting(initialization, int, ENV_INIT_TIMEOUT),
        "heartbeat_timeout_seconds": DEFAULT_HEARTBEAT_TIMEOUT if heartbeat is None else heartbeat,
        "shutdown_timeout_seconds": setting(shutdown, int, ENV_SHUTDOWN_TIMEOUT),
    }
    return {name: value for name, value in timeouts.items() if value is not None}


def check_complete(settings: Mapping[str, Any]) -> None:
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


def check_same_run(settings: Mapping[str, Any]) -> None:
    """A second call is fine if it describes the run already joined (a program and a library may both call)."""
    now = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
    clash = {name: (settings[name], value) for name, value in now.items() if settings[name] not in (None, value)}
    if clash:
        raise RuntimeError(
            f"initialize: jax.distributed is already initialised as process {now['process_id']} of "
            f"{now['num_processes']}, which differs from {clash} (given, running); it can be initialised once"
        )
