"""Run a training program as a user starts it: `python -m <program>` in a fresh process (JAX opens its compile
cache and compiles op-by-op programs once per process), without the test session's cache settings."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_program(program: str, args: list[str], cwd: Path, timeout: float = 600) -> str:
    """The stdout of `python -m <program> <args>` run in `cwd`; its whole output in the failure when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    proc = subprocess.run(
        [sys.executable, "-m", program, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
