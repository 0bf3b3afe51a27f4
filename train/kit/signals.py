"""Stopping a training program cleanly on SIGTERM and SIGINT, from its first line until it returns.

A preemptible machine announces its end with SIGTERM; a person stops a run with Ctrl-C (SIGINT). Either way
the run should end with one line and, once it has trained, with a checkpoint. Three phases:

- starting up (importing JAX, parsing, preparing data, building and compiling the state): nothing has
  trained, so a signal ends the process at once with one line and status 128 + the signal's number. It
  leaves through `os._exit`, because an exception raised there can land inside an import (which turns it
  into an `ImportError`) or inside one of JAX's callbacks (which swallows it, and the run trains on);
- training: the first signal is a request (`requested`); the loop saves after the step in flight and exits
  with status 0. In a run of several processes the processes agree on the step to stop at first
  (`purejax.parallel.distributed.reached_preemption_sync_point`);
- finishing (after the last checkpoint): a signal ends the process at once with status 0.

A program installs the start-up handlers before its heavy imports, so that even a signal that arrives while
JAX loads gets its one line:

    from train.kit import signals

    if __name__ == "__main__":
        signals.exit_at_once_while_starting()  # before `import jax` below

    import jax  # noqa: E402

and then runs under `with StopSignal() as stop:`. This module imports nothing beyond the standard library,
so importing it costs nothing.
"""

import os
import signal
import sys
import threading
import time
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # SIGTERM last: its handler in place means both are


class StopSignal:
    """SIGTERM and SIGINT over the whole run of a program, from its first line until it returns; see the
    module docstring for the three phases.

    A second signal exits at once, without saving. One that comes within `SAME_NOTICE` seconds of the first
    is the same notice delivered twice (Ctrl-C reaches a launcher and its children, and the launcher forwards
    it too) and is ignored.
    """

    SIGNALS = SIGNALS
    SAME_NOTICE = 0.25  # seconds

    def __init__(self):
        self.requested = False
        self.phase = "starting"
        self._received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def training(self) -> None:
        """From here a signal is a request to save and stop (the loop's first step is next)."""
        self.phase = "training"

    def finishing(self) -> None:
        """Everything is saved: from here a signal exits at once with status 0. Called after the last save;
        if a signal asked for that save, the program leaves now."""
        self.phase = "finishing"
        if self.requested:
            raise SystemExit(0)

    def _handle(self, signum: int, frame: Any) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        first = self._received_at is None
        if not first and now - self._received_at < self.SAME_NOTICE:
            return
        self._received_at = now
        if self.phase == "starting":
            _exit(f"{name}: nothing trained yet; exiting", 128 + signum)
        if self.phase == "finishing":
            _exit(f"{name}: everything is saved; exiting", 0)
        if not first:
            _exit(f"{name} again: exiting now, without saving", 128 + signum)
        self.requested = True
        _say(f"{name}: saving a checkpoint after this step, then exiting (send again to exit now)")

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        """Put the previous handlers back, unless a signal has come or they were the start-up ones of a
        program run from the command line: then ours stay, so a late signal gets its line, not a traceback."""
        if self._received_at is not None or _exit_starting in self._previous.values():
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_at_once_while_starting() -> None:
    """Handlers that end the process at once with one line on SIGTERM or SIGINT, for the start of a program
    before it imports JAX; `StopSignal` replaces them when the program's `main` begins."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _exit_starting)


def _exit_starting(signum: int, frame: Any) -> None:
    _exit(f"{signal.Signals(signum).name}: nothing trained yet; exiting", 128 + signum)


def _say(line: str) -> None:
    print(f"\n{line}", file=sys.stderr, flush=True)


def _exit(line: str, status: int) -> None:
    """Say `line` and end the process now: no exception for code in flight to catch, swallow or convert."""
    _say(line)
    sys.stdout.flush()
    os._exit(status)
