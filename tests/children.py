"""Checks that need several devices run in a child process: the simulated device count (XLA_FLAGS) is fixed
when jax starts, and the test process has one device. A child script (a `*_child.py`, or a test file run as a
script) computes on its 8 simulated devices and writes its numbers as JSON; the tests assert on them."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
