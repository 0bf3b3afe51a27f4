"""Stopping a program on SIGTERM and SIGINT (`train.signals`) in each phase of its run, in child
processes where a real signal can be sent: one line and no traceback while starting up (JAX's import
included), a checkpoint and status 0 while training, status 0 after the last save."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from train.kit import signals

ROOT = Path(__file__).resolve().parents[2]


def test_two_deliveries_of_one_signal_count_once():
    stop = signals.StopSignal()
    stop.training()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGINT, None)  # within SAME_NOTICE: the same notice, forwarded by a launcher
    assert stop.requested


def script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `body` in a fresh Python (so real signals can be sent) with `signals`, `os`, `signal`, `time` imported."""
    code = "import os, signal, time\nfrom train.kit import signals\n" + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_up_exits_at_once_without_a_traceback(signum):
    done = script(f"""
        with signals.StopSignal():
            os.kill(os.getpid(), {int(signum)})
            time.sleep(5)
        print("not reached")
    """)
    assert done.returncode == 128 + signum, done
    assert f"{signal.Signals(signum).name}: nothing trained yet; exiting" in done.stderr
    assert "Traceback" not in done.stderr and "not reached" not in done.stdout


def test_a_second_signal_exits_at_once_and_a_late_one_never_shows_a_traceback():
    done = script("""
        import atexit
        with signals.StopSignal() as stop:
            stop.training()
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the same notice twice: counted once
            assert stop.requested
            print("saving", flush=True)
        # exiting after the save: a second Ctrl-C during interpreter exit
        atexit.register(lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))
        raise SystemExit(0)
    """)
    assert done.returncode == 128 + signal.SIGINT, done
    assert "saving" in done.stdout and "SIGINT again: exiting now, without saving" in done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


def test_a_signal_after_the_last_save_exits_0():
    done = script("""
        with signals.StopSignal() as stop:
            stop.training()
            stop.finishing()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    """)
    assert done.returncode == 0 and "everything is saved; exiting" in done.stderr, done


def test_a_late_signal_after_the_save_it_asked_for_says_so_and_exits_0():
    """Two Ctrl-Cs 50 ms apart: the first asks for the save, the second comes once the checkpoint is written;
    it once said "exiting now, without saving", which was false."""
    done = script("""
        import atexit
        with signals.StopSignal() as stop:
            stop.training()
            os.kill(os.getpid(), signal.SIGINT)
            print("saved", flush=True)  # the loop's save after the step in flight
            atexit.register(lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))
            stop.finishing()  # raises SystemExit(0): the save was asked for
    """)
    assert done.returncode == 0, done
    assert "saved" in done.stdout and "SIGINT: everything is saved; exiting" in done.stderr
    assert "without saving" not in done.stderr and "Traceback" not in done.stderr


def caught_signals(pid: int) -> int:
    """The mask of signals process `pid` has a handler for (Linux's /proc/PID/status, SigCgt)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the handlers from Linux's /proc")
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_program_imports_jax_gets_one_line(tmp_path, signum, delay):
    """`python -m train.gpt` installs its handlers before it imports JAX: a signal sent once they
    are in place (seen in /proc, so the test does not race Python's own start-up) and while JAX loads ends
    the run with one line and 128 + the signal, never a traceback, an ImportError, or a run trained to its end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "train.gpt", "--config=gpt_tiny", "--max_iters=3", "--out_dir=out"]
    child = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not caught_signals(child.pid) & (1 << (signal.SIGTERM - 1)) and child.poll() is None:
        time.sleep(0.001)
    time.sleep(delay)
    child.send_signal(signum)
    out, err = child.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert child.returncode == 128 + signum, (out, err)
    assert f"{name}: nothing trained yet; exiting" in err
    assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" not in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("ckpt_*"))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's state from Linux's /proc")
@pytest.mark.parametrize("program", ["gpt", "classify", "flow", "finetune"])
def test_every_program_has_its_handlers_in_place_before_jax_loads(tmp_path, program):
    """The handlers come before the heavy imports: when SIGTERM's handler appears, jaxlib is not yet mapped
    into the process (without the start-up guard they appear only in `main`, long after)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", f"train.{program}", f"--out_dir={tmp_path / 'out'}"]
    child = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not caught_signals(child.pid) & (1 << (signal.SIGTERM - 1)):
            assert child.poll() is None, f"{program} ended before installing its handlers"
            time.sleep(0.0005)
        assert "jaxlib" not in Path(f"/proc/{child.pid}/maps").read_text()
    finally:
        child.kill()
        child.wait()
