"""Preemption in a run of several processes: every process stops after the same step, whichever got the notice.

A preemptible machine announces its end with SIGTERM, a few seconds to minutes ahead. In a single process
the program's Python handler sees it and saves after the step in flight. With several processes that is
not enough: saving is a collective, so a process that stopped alone would leave the others waiting in it.
A pod's preemption may reach one host only; a launcher or `scancel` reaches all of them, at slightly
different steps.

JAX's preemption service solves exactly this. `jax.distributed.initialize` (with
`jax_enable_preemption_service`, which `purejax.parallel.initialize` switches on) installs a notifier for
SIGTERM in place of Python's handler. On a notice it tells the coordination service; the processes agree on
a step one past the furthest any of them has reached; and `reached_sync_point(step)`, asked after every step
by every process, is True on all of them at that step. Nothing crosses between processes until a notice
comes, so asking costs no collective and no wait for the device.

    for step in range(start, total):
        state = train_step(state, batch)
        if preemption.reached_sync_point(step + 1):
            checkpoint.save(...)    # on every process: a collective
            break

A SIGINT (Ctrl-C) still reaches Python's handler; `notify()` hands it to the notifier, so it takes the same
path as a SIGTERM.
"""

import os
import signal

import jax
from jax.experimental import multihost_utils


def notify() -> None:
    """Give this process's own stop request (a Ctrl-C its Python handler saw) to JAX's preemption notifier, as
    a preemption notice: a SIGTERM to itself, which the notifier catches in place of Python."""
    os.kill(os.getpid(), signal.SIGTERM)


def reached_sync_point(step: int) -> bool:
    """True on every process at the same step once any process has had a preemption notice; asked after every
    step, by every process, with the same increasing `step`. Always False in a single-process run."""
    if jax.process_count() == 1:
        return False
    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError as e:  # the service is off: jax.distributed was initialised without it
        raise RuntimeError(
            f"preemption.reached_sync_point: {e} (purejax.parallel.initialize switches it on; a program that "
            "calls jax.distributed.initialize itself must first set "
            "jax.config.update('jax_enable_preemption_service', True))"
        ) from None
