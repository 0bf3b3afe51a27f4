"""The checks that need 8 devices run once per session in a child process (parallel_child.py: XLA_FLAGS must
be set before jax is imported, and this process has one device); the tests assert on the numbers it writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def mesh_results(tmp_path_factory) -> dict:
    """What parallel_child.py measured on 8 simulated CPU devices (see its functions for each entry)."""
    out = tmp_path_factory.mktemp("parallel") / "results.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parents[2])}
    done = subprocess.run(
        [sys.executable, str(HERE / "parallel_child.py"), str(out)], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise AssertionError(f"parallel_child.py exited with {done.returncode}:\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())
