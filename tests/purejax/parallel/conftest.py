"""The checks that need 8 devices run once per session in a child process (parallel_child.py: XLA_FLAGS must
be set before jax is imported, and this process has one device); the tests assert on the numbers it writes."""

from pathlib import Path

import pytest

from tests.children import child_results, once_per_session

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def mesh_results(tmp_path_factory) -> dict:
    """What parallel_child.py measured on 8 simulated CPU devices (see its functions for each entry), once for
    the whole session however the test files are shared out over workers."""
    return once_per_session(tmp_path_factory, "parallel", lambda out: child_results(HERE / "parallel_child.py", out))
