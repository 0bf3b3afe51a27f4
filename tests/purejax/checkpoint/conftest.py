"""Fixtures shared by the checkpoint tests: running the child scripts beside this file in fresh processes,
and one large checkpoint, written once per session by a child that measures what its save cost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import once_per_session

HERE = Path(__file__).resolve().parent


def _run_child(script: str, *args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise AssertionError(f"{script} {' '.join(args)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


@pytest.fixture(scope="session")
def run_child():
    """`run_child(script, *args)`: run a script beside this file in a fresh Python process; its stdout."""
    return _run_child


@pytest.fixture(scope="session")
def big_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """A 240 MB checkpoint saved in 16 MiB chunks, and what saving it cost (see peak_memory.py):
    `(path, {"data": bytes, "extra": peak RSS the save added, "chunk_bytes": 16 MiB})`."""
    chunk_bytes = 16 * 2**20

    def save(directory: Path) -> tuple[str, dict]:  # once for the session, whichever worker asks first
        path = directory / "big.msgpack"
        out = _run_child("peak_memory.py", "save", str(path), "240", str(chunk_bytes))
        return str(path), {**json.loads(out.strip().splitlines()[-1]), "chunk_bytes": chunk_bytes}

    path, cost = once_per_session(tmp_path_factory, "big_checkpoint", save)
    return Path(path), cost
