"""A preemption notice (SIGTERM) in a run of several processes: whichever processes get it, every process
stops after the same step, one checkpoint is saved, every process exits 0, and the resumed run is bit for bit
the uninterrupted one. The processes are started by hand (as a cluster script would) so that the signal can
go to one of them; the launcher's case is the command the reliability campaign ran."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from purejax import checkpoint
from tests.train.test_gpt import ROOT, TINY, _leaves, corpus, final_state  # noqa: F401 - corpus: a fixture

pytestmark = pytest.mark.slow
# JAX's notifier looks for a SIGTERM once a second, so the run is long enough (several seconds even on a fast
# machine) that the notice always lands while it trains; a run that ended first would have nothing to stop.
ITERS = 400
COMMON = [
    *TINY,
    f"--max_iters={ITERS}",
    "--lr_decay_iters=60",
    "--eval_interval=1000",
    "--eval_iters=1",
    "--log_interval=1",
    "--n_layer=1",
    "--compile_cache=off",
]


def start_processes(n: int, args: list[str], cwd: Path, port: int) -> list[subprocess.Popen]:
    """`n` processes of `python -m train.gpt --dp=n`, joined through the environment."""
    procs = []
    for i in range(n):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PUREJAX_COORDINATOR": f"127.0.0.1:{port}",
            "PUREJAX_NUM_PROCESSES": str(n),
            "PUREJAX_PROCESS_ID": str(i),
        }
        command = [sys.executable, "-m", "train.gpt", f"--dp={n}", *args]
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def wait_for_training(metrics: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, finish_all(procs)
        time.sleep(0.02)


def finish_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.stdout.read().decode()) for p in procs]


def preempt(tmp_path: Path, n: int, targets: list[int], args: list[str], port: int) -> int:
    """Train with `n` processes, SIGTERM the `targets` once training has begun; check that all stopped
    together and saved once; return the step they stopped at."""
    procs = start_processes(n, [*args, "--out_dir=stopped"], tmp_path, port)
    wait_for_training(tmp_path / "stopped" / "metrics.jsonl", procs)
    for i in targets:
        procs[i].send_signal(signal.SIGTERM)
    done = finish_all(procs)
    assert [status for status, _ in done] == [0] * n, done
    assert done[0][1].count("(signal)") == 1, done[0][1]  # process 0 writes the one checkpoint
    manager = checkpoint.CheckpointManager(tmp_path / "stopped")
    stopped_at = manager.latest_step()
    assert 0 < stopped_at < ITERS and checkpoint.restore(manager.path(stopped_at))[1].metadata["reason"] == "signal"
    return stopped_at


@pytest.mark.parametrize(("n", "targets"), [(2, [0]), (2, [0, 1]), (4, [1])], ids=["2-to-0", "2-to-all", "4-to-1"])
def test_sigterm_to_some_or_all_processes_stops_every_process_at_one_step(tmp_path, corpus, n, targets):  # noqa: F811
    preempt(tmp_path, n, targets, [*COMMON, f"--dataset={corpus}"], port=23400 + 10 * n + len(targets))


def test_after_one_process_is_preempted_the_resumed_run_is_bit_exact(tmp_path, corpus):  # noqa: F811
    """The pod's case: the notice reaches process 1 alone, which neither logs nor writes files."""
    args = [*COMMON, f"--dataset={corpus}", "--dropout=0.1"]
    stopped_at = preempt(tmp_path, 2, [1], args, port=23451)
    end = [f"--max_iters={stopped_at + 10}"]  # ten steps past the stop (the schedule is lr_decay_iters', not this)
    resumed = start_processes(2, [*args, *end, "--out_dir=stopped", "--init_from=resume"], tmp_path, 23452)
    resumed = finish_all(resumed)
    assert [status for status, _ in resumed] == [0, 0] and f"at iter {stopped_at}" in resumed[0][1], resumed
    straight = finish_all(start_processes(2, [*args, *end, "--out_dir=straight"], tmp_path, 23453))
    assert [status for status, _ in straight] == [0, 0], straight
    for a, b in zip(
        _leaves(final_state(tmp_path / "straight", stopped_at + 10)),
        _leaves(final_state(tmp_path / "stopped", stopped_at + 10)),
    ):
        np.testing.assert_array_equal(a, b)


def test_sigterm_to_the_launcher_stops_its_processes_with_one_checkpoint(tmp_path, corpus):  # noqa: F811
    """The reliability campaign's command: under `purejax.parallel.launch`, SIGTERM once ran on for ten
    minutes without a checkpoint."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "purejax.parallel.launch",
        "--num_processes=2",
        "--timeout=300",
        "--",
        "-m",
        "train.gpt",
        "--dp=2",
        *COMMON,
        f"--dataset={corpus}",
        "--out_dir=stopped",
    ]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_training(tmp_path / "stopped" / "metrics.jsonl", [launcher])
    launcher.send_signal(signal.SIGTERM)
    status, out = finish_all([launcher])[0]
    assert status == 0 and out.count("(signal)") == 1, out
    assert 0 < checkpoint.CheckpointManager(tmp_path / "stopped").latest_step() < ITERS
