"""Test-session set-up: run-time shape and type checking of everything in `purejax`, `models` and `train`,
and a persistent compilation cache.

jaxtyping's import hook decorates every annotated function in those packages with beartype as they are
imported, so a wrong shape or dtype fails at the call with the argument's name. It must be installed before
anything imports purejax, which is why it lives here, at the top of the root conftest. `is_pep484_tower`
lets an int stand where a float is annotated, as Python's own typing rules (PEP 484) do. Training runs
outside the tests do not pay for any of it.

The compilation cache (set through the environment, so the training programs the tests start as
subprocesses share it) lets a program compiled by one test, or one run of the suite, be reused by the next.

Most of the suite's time is XLA compiling programs that then run for milliseconds, so the suite asks XLA for
little optimization (`JAX_DISABLE_MOST_OPTIMIZATIONS`, JAX's switch for exactly that: LLVM's expensive passes
off; the HLO passes that fuse, assign buffers and place collectives still run, so the tests that count
collectives, copies and bytes see what a training run compiles), and on jaxlib 0.10 for XLA:CPU's older
emitters (`--xla_cpu_use_fusion_emitters=false`), which compile a small program in less than half the time
(docs/benchmarks.md, `python -m bench.suite_compile`). jaxlib 0.12 no longer knows that flag, and XLA stops
the process on a flag it does not know, so it is set only where jaxlib has it. The few tests that read the
program a user compiles (its optimized HLO, or bit-for-bit agreement with optax) compile with the emitters
on. Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test fully optimized programs.
"""

import os
from pathlib import Path

from bench.suite_compile import OLDER_EMITTERS, has_older_emitters  # the standard library only: JAX not yet

CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


flags = os.environ.get("XLA_FLAGS", "")
if has_older_emitters() and os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0" and "fusion_emitters" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {OLDER_EMITTERS}".strip()

from jaxtyping import install_import_hook  # noqa: E402

install_import_hook(
    ["purejax", "models", "train"], "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))"
)

# How `dev.py test` shares the suite between its pytest-xdist workers (`--dist loadfile`, made here by
# `pytest_xdist_make_scheduler`): each test file is one unit of work, run whole on one worker, so a file's
# module fixtures (the 8-device child processes) are made once; the docs pages are a unit each (every page is
# its own test and shares nothing with the others), so they spread over the workers. Units start in the order
# below: the slowest files (whole training runs, 8-device children) first, so the workers share them instead of
# one finishing the last of them alone, then the docs pages, then every other file in its place. xdist would
# otherwise sort the units by their number of tests.
RUN_FIRST = (
    "tests/purejax/parallel/test_pipeline.py",
    "tests/train/test_gpt.py",
    "tests/train/test_pipeline_train.py",
    "tests/train/test_parallel.py",
    "tests/models/test_gpt_sequence_parallel.py",
    "tests/purejax/parallel/test_experts.py",
    "tests/bench/test_bench_parallel.py",
    "tests/test_docs.py",
)
TEST_PER_UNIT = ("tests/test_docs.py::",)  # nodeid prefixes whose tests are units of their own


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent

    def rank(item) -> int:
        path = Path(item.path).resolve().relative_to(root).as_posix()
        return RUN_FIRST.index(path) if path in RUN_FIRST else len(RUN_FIRST)

    items.sort(key=rank)  # stable: a file's tests stay together and in order


def pytest_xdist_make_scheduler(config, log):
    """loadfile, with the docs pages split into a unit each and the units in collection order (see above)."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for any other --dist
    from xdist.scheduler import LoadFileScheduling

    class FilesAndPages(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith(TEST_PER_UNIT) else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return FilesAndPages(config, log)
