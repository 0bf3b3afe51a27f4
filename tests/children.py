"""Checks that need several devices run in a child process: the simulated device count (XLA_FLAGS) is fixed
when jax starts, and the test process has one device. A child script (a `*_child.py`, or a test file run as a
script) computes on its 8 simulated devices and writes its numbers as JSON; the tests assert on them."""

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def child_results(script: str | Path, out_dir: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run `python script out_dir/results.json *args` on the CPU with the project importable, and return the
    JSON it wrote; a child that fails raises with the end of its stderr."""
    out = Path(out_dir) / "results.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **(env or {})}
    command = [sys.executable, str(script), str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise AssertionError(f"{Path(script).name} exited with {done.returncode}:\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


def once_per_session(tmp_path_factory: Any, name: str, produce: Callable[[Path], Any]) -> Any:
    """`produce(directory)`'s value (JSON), for a session fixture that several test files use: computed once
    per test session, not once per pytest-xdist worker. The first worker to ask computes it in a directory of
    the session's temporary one, which every worker shares, and leaves it there as JSON; the others wait for
    it (a file lock) and read it. Without xdist the directory is this session's own."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return produce(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / f"once-{name}"  # the parent: this session's, all workers'
    shared.mkdir(exist_ok=True)
    value = shared / "value.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not value.is_file():
            value.write_text(json.dumps(produce(shared)))
        return json.loads(value.read_text())
