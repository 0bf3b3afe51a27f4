"""Test-session set-up: run-time shape and type checking of everything in `purejax` (its models and programs
included), and a persistent compilation cache.

jaxtyping's import hook decorates every annotated function in those packages with beartype as they are
imported, so a wrong shape or dtype fails at the call with the argument's name. It must be installed before
anything imports purejax, which is why it lives here, at the top of the root conftest. `is_pep484_tower`
lets an int stand where a float is annotated, as Python's own typing rules (PEP 484) do. Training runs
outside the tests do not pay for any of it.

The compilation cache (set through the environment, so the training programs the tests start as
subprocesses share it) lets a program compiled by one test, or one run of the suite, be reused by the next.
"""

import os
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

from jaxtyping import install_import_hook  # noqa: E402

install_import_hook(["purejax"], "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

# The slowest files (whole training runs, 8-device child processes, every docs page) start first, so that the
# pytest-xdist workers (`dev.py test`, a file per worker at a time) share them instead of one worker finishing
# the last of them alone. Every other file keeps its place.
RUN_FIRST = (
    "tests/test_docs.py",
    "tests/purejax/train/test_gpt.py",
    "tests/purejax/train/test_pipeline_train.py",
    "tests/purejax/train/test_parallel.py",
    "tests/purejax/parallel/test_pipeline.py",
    "tests/purejax/models/test_gpt_sequence_parallel.py",
    "tests/purejax/parallel/test_experts.py",
    "tests/bench/test_bench_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent

    def rank(item) -> int:
        path = Path(item.path).resolve().relative_to(root).as_posix()
        return RUN_FIRST.index(path) if path in RUN_FIRST else len(RUN_FIRST)

    items.sort(key=rank)  # stable: a file's tests stay together and in order
