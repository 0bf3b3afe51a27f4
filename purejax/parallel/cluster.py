"""How this process was started, read from its environment before JAX starts: by Slurm's `srun`, by Open MPI's
`mpirun`, or by `python -m purejax.parallel.launch`; and, in the last case, how it dies with its launcher.

A launcher tells each process it starts who it is through environment variables:

    launcher                 processes              this process           where JAX finds the coordinator
    srun (Slurm)             SLURM_NTASKS           SLURM_PROCID           first node of SLURM_STEP_NODELIST,
                                                                           port from SLURM_JOB_ID
    mpirun (Open MPI)        OMPI_COMM_WORLD_SIZE   OMPI_COMM_WORLD_RANK   the host in OMPI_MCA_orte_hnp_uri
                                                                           (Open MPI 4; version 5 sets none)

`jax.distributed.initialize()` reads the same variables itself (its "cluster auto-detection"), and
`purejax.parallel.initialize` leaves the joining to it. What this module adds is what JAX cannot say before it
starts: whether there is a multi-process launch to join at all (a program run by hand inside a Slurm allocation,
or as one task, is one process and must not wait for others), and how many processes there will be (the
training programs size their simulated CPU devices by it). The checks mirror JAX's own: Open MPI first, then
Slurm where all five variables that JAX's Slurm detection reads are set (`srun` sets them for each task).
"""

import os
import signal
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OPEN_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
OPEN_MPI_URI = "OMPI_MCA_orte_hnp_uri"  # the launcher's address, which JAX's Open MPI detection needs
ENV_LAUNCHER_PIPE = "PUREJAX_LAUNCHER_PIPE"  # set by purejax.parallel.launch: "<fd>:<inode>" of a pipe to watch


@dataclass(frozen=True)
class Launch:
    """A launch by `srun` or `mpirun`, as the environment describes it.

    `jax_detects` is False where JAX's detection cannot find the coordinator by itself (Open MPI 5 sets no
    `OMPI_MCA_orte_hnp_uri`): the caller then gives the address and passes the counts on explicitly."""

    launcher: str
    num_processes: int
    process_id: int
    jax_detects: bool = True


def detect(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The `srun` or `mpirun` launch that started this process, or None when neither did."""
    if all(name in environ for name in OPEN_MPI_VARIABLES):
        count, rank = (_int(environ, name) for name in OPEN_MPI_VARIABLES)
        return Launch("Open MPI (mpirun)", count, rank, jax_detects=OPEN_MPI_URI in environ)
    if all(name in environ for name in SLURM_VARIABLES):
        return Launch("Slurm (srun)", _int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_PROCID"))
    return None


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(
            f"${name} is {environ[name]!r}, which is not an int; is this process really started by "
            "a launcher, or is the variable left over in the environment?"
        ) from None


# ---------------------------------------------------------------- dying with purejax.parallel.launch

_watching = threading.Event()


def die_with_launcher() -> None:
    """If `purejax.parallel.launch` started this process, make it (and everything it started) end when the
    launcher ends, even by SIGKILL, which the launcher cannot pass on.

    The launcher holds the write end of a pipe and never writes; each process it starts gets the read end.
    However the launcher dies, the kernel closes its end, and a read of ours returns: a thread waiting in
    that read then SIGKILLs our process group (the launcher starts each process as the leader of its own
    group). The variable names the pipe's inode as well as its descriptor, so that a grandchild that
    inherited the variable but not the descriptor (or has another file at that number) does nothing.
    Idempotent; a no-op in a process the launcher did not start.
    """
    value = os.environ.get(ENV_LAUNCHER_PIPE, "")
    if not value or _watching.is_set():
        return
    try:
        fd, inode = (int(part) for part in value.split(":"))
        info = os.fstat(fd)
    except (ValueError, OSError):  # malformed, or not our descriptor here
        return
    if not stat.S_ISFIFO(info.st_mode) or info.st_ino != inode:
        return
    _watching.set()
    threading.Thread(target=_end_when_closed, args=(fd,), name="purejax-launcher-watch", daemon=True).start()


def _end_when_closed(fd: int) -> None:
    while os.read(fd, 1):  # the launcher never writes: only end-of-file (it is gone) returns b""
        pass
    if os.getpgrp() == os.getpid():  # we lead our group: take our own children with us
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
