"""Start N processes of one Python program on this machine as one multi-process JAX run.

    python -m purejax.parallel.launch --num_processes=2 -- -m my_project.train --steps=100
    python -m purejax.parallel.launch --num_processes=2 --devices_per_process=2 --timeout=600 -- my_script.py

Each process gets `PUREJAX_COORDINATOR=127.0.0.1:<free port>`, `PUREJAX_NUM_PROCESSES` and
`PUREJAX_PROCESS_ID` in its environment, which `purejax.parallel.initialize()` reads; `--devices_per_process`
makes each simulate that many CPU devices (XLA's `--xla_force_host_platform_device_count`), which is how the
tests run a 2-process x 2-device job on one CPU. Output lines are prefixed with the process id.

The launcher passes its first SIGTERM or SIGINT on to every process, so that a program which saves on a
signal (like `train.gpt`) stops cleanly on a preemption notice; a second one kills them all. When one process
fails, the others get `--failure_grace` seconds (30) to notice and exit on their own (JAX's heartbeats,
`PUREJAX_HEARTBEAT_TIMEOUT`, 20 s by default, make them abort), then they are killed: a process that died
before joining the run would otherwise leave the others waiting in `initialize` for minutes. If the launcher
itself is killed (SIGKILL, which it cannot pass on), its processes end with it: each watches a pipe that only
the launcher holds open (`purejax.parallel.cluster.die_with_launcher`, started by `initialize`). The
wall-clock `--timeout` is the last resort against a hang: when it passes, every process still running is
killed. The exit status is 0 when every process exited 0, 124 on a timeout, and otherwise the status of the
process that failed first (a negative status -N, killed by signal N, is reported as 128 + N, as shells do).

On several hosts there is nothing to launch from one place: run the program once per host with the
variables set (docs/multihost.md).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from purejax.parallel import cluster, distributed

TIMED_OUT = 124  # the exit status of coreutils' timeout(1)


@dataclass(frozen=True)
class ProcessResult:
    """What one launched process did: its exit status (None if the launcher had to kill it at the timeout;
    negative -N if a signal N ended it) and its interleaved stdout and stderr."""

    process_id: int
    returncode: int | None
    output: str
    ended: float = 0.0  # when it ended (time.monotonic()), to tell which failure came first

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def launch(
    args: Sequence[str],
    num_processes: int,
    *,
    timeout: float,
    devices_per_process: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    echo: bool = False,
    forward_signals: bool = False,
    failure_grace: float = 30.0,
) -> list[ProcessResult]:
    """Run `python *args` as `num_processes` processes of one JAX run; wait for all of them (at most
    `timeout` seconds, then kill the rest) and return what each did, in process order.

    Arguments:
        args: what follows `python`: `["-m", "my_project.train"]` or `["script.py", ...]`.
        num_processes: how many processes to start; process 0 hosts the coordinator.
        timeout: hard wall-clock limit in seconds for the whole run.
        devices_per_process: simulate this many CPU devices in each process (None: leave XLA_FLAGS alone).
        env: the environment to start from (default: this process's), plus the variables set here.
        cwd: the working directory of every process.
        echo: also print each output line as it arrives, prefixed `[process_id]`.
        forward_signals: pass the first SIGTERM or SIGINT this process gets on to every process and keep
            waiting for them; the second kills them all (call from the main thread).
        failure_grace: once a process has failed, seconds the others get to exit before they are killed.
    """
    if num_processes < 1:
        raise ValueError(f"launch: num_processes must be at least 1, got {num_processes}")
    base = dict(os.environ if env is None else env)
    if devices_per_process is not None:
        flag = f"--xla_force_host_platform_device_count={devices_per_process}"
        base["XLA_FLAGS"] = f"{base.get('XLA_FLAGS', '')} {flag}".strip()
    base[distributed.ENV_COORDINATOR] = f"127.0.0.1:{_free_port()}"
    base[distributed.ENV_NUM_PROCESSES] = str(num_processes)
    # Only this process holds the write end: when it ends, however it ends, the children read end-of-file.
    watched, held = os.pipe()
    base[cluster.ENV_LAUNCHER_PIPE] = f"{watched}:{os.fstat(watched).st_ino}"
    procs, readers, outputs = [], [], []
    deadline = time.monotonic() + timeout
    previous = _forward_signals_to(procs) if forward_signals else {}
    try:
        for i in range(num_processes):
            proc = subprocess.Popen(
                [sys.executable, *args],
                env={**base, distributed.ENV_PROCESS_ID: str(i)},
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                pass_fds=(watched,),
                start_new_session=True,  # its own process group, so that killing it kills its children too
            )
            procs.append(proc)
            outputs.append([])
            prefix = f"[{i}] " if echo else None
            readers.append(threading.Thread(target=_collect, args=(proc, outputs[-1], prefix), daemon=True))
            readers[-1].start()
        codes, ended = _wait_all(procs, deadline, failure_grace)
    except BaseException:  # Ctrl-C, SIGTERM turned into SystemExit, a failed start: leave nothing running
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(watched)
        os.close(held)
    for reader in readers:
        reader.join(timeout=10)  # what is left in the pipe; a grandchild holding it open must not hang us
    runs = enumerate(zip(codes, outputs, ended))
    return [ProcessResult(i, code, "".join(lines), end) for i, (code, lines, end) in runs]


def exit_status(results: Sequence[ProcessResult]) -> int:
    """0 if every process exited 0; 124 if any had to be killed at the timeout; else the status of the
    process that failed first, with death by signal N reported as 128 + N."""
    if any(r.timed_out for r in results):
        return TIMED_OUT
    failed = sorted((r for r in results if r.returncode), key=lambda r: r.ended)  # stable: ties in process order
    if not failed:
        return 0
    first = failed[0].returncode
    return 128 - first if first < 0 else first


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m purejax.parallel.launch",
        description="Run a Python program as N local processes of one multi-process JAX run.",
        epilog="example: python -m purejax.parallel.launch --num_processes=2 -- -m my_project.train --steps=100",
    )
    parser.add_argument("--num_processes", type=int, required=True, help="processes to start")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before every process is killed")
    parser.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices each")
    parser.add_argument(
        "--failure_grace",
        type=float,
        default=30.0,
        help="once a process has failed, seconds the others get before they are killed",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: what follows `python`")
    options = parser.parse_args(argv)
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    if not args:
        parser.error("give the program after --, e.g. -- -m my_project.train or -- script.py")
    results = launch(
        args,
        options.num_processes,
        timeout=options.timeout,
        devices_per_process=options.devices_per_process,
        echo=True,
        forward_signals=True,
        failure_grace=options.failure_grace,
    )
    for r in results:
        status = f"killed after the {options.timeout:g} s timeout" if r.timed_out else f"exit status {r.returncode}"
        print(f"[launch] process {r.process_id}: {status}", file=sys.stderr)
    return exit_status(results)


def _forward_signals_to(procs: list[subprocess.Popen]) -> dict[int, Any]:
    """Handlers for SIGTERM and SIGINT: the first is sent on to each process's group, the second raises
    SystemExit, which makes `launch` kill them. Returns the previous handlers."""
    received = []

    def forward(signum, frame):
        if received:
            raise SystemExit(128 + signum)
        received.append(signum)
        print(f"[launch] {signal.Signals(signum).name}: passed on to every process", file=sys.stderr, flush=True)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signum)

    return {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}


def _free_port() -> int:
    """A TCP port free right now (the OS picks it); process 0 binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(proc: subprocess.Popen, lines: list[str], prefix: str | None) -> None:
    for line in proc.stdout:
        lines.append(line)
        if prefix is not None:
            print(prefix + line, end="", flush=True)


def _wait_all(procs: Sequence[subprocess.Popen], deadline: float, grace: float) -> tuple[list, list[float]]:
    """Every process's exit status and when it ended. A process still running at `deadline` is killed and
    gets None (timed out); once one has failed, those still running `grace` seconds later are killed and
    get their signal status."""
    codes, ended, kill_at = [None] * len(procs), [0.0] * len(procs), deadline
    running = set(range(len(procs)))
    while running:
        now = time.monotonic()
        for i in sorted(running):
            if procs[i].poll() is not None:
                codes[i], ended[i] = procs[i].returncode, now
                running.discard(i)
                if procs[i].returncode:
                    kill_at = min(kill_at, now + grace)
        if running and now >= kill_at:
            for i in running:
                _kill(procs[i])
                codes[i], ended[i] = (None if kill_at == deadline else procs[i].returncode), time.monotonic()
            break
        time.sleep(0.05)
    return codes, ended


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (the process and anything it started), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it has exited and been reaped already
        pass
    proc.wait()


if __name__ == "__main__":
    sys.exit(main())
