"""Compile time under the test suite's XLA settings (tests/conftest.py): most of the suite's time is XLA
compiling small programs that then run for milliseconds, so the suite compiles them with less effort.

    python -m bench.suite_compile [--repeats 3] [--n_layer 2]

One GPT's training gradient (`bench.gpt_compile.compile_seconds`: 4 heads, width 128, block 64, batch 8)
compiled in a fresh process under each setting, without a compilation cache:

    defaults                JAX's and XLA's own
    most optimizations off  JAX_DISABLE_MOST_OPTIMIZATIONS=1 (LLVM's expensive passes off; the HLO passes
                            that fuse, assign buffers and place collectives still run)
    + older emitters        that, and XLA:CPU's older emitters (--xla_cpu_use_fusion_emitters=false), which
                            jaxlib 0.10 has and jaxlib 0.12 no longer knows (the row is left out there)

Each process compiles the program `--repeats` times afresh and reports the median (its first compile pays
for LLVM's start-up, so a process's first is one of them but not the only one); the settings run one after
another, each in its own process. docs/benchmarks.md has the table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
SETTINGS = {
    "defaults": {},
    "most optimizations off": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "+ older emitters": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": OLDER_EMITTERS},
}


def has_older_emitters() -> bool:
    """Whether this jaxlib knows `--xla_cpu_use_fusion_emitters` (0.10 does; XLA aborts on a flag it lacks)."""
    return tuple(int(part) for part in version("jaxlib").split(".")[:2]) == (0, 10)


def settings() -> dict[str, dict[str, str]]:
    """The settings this jaxlib can run: each name to the environment variables it sets."""
    return {name: env for name, env in SETTINGS.items() if has_older_emitters() or "XLA_FLAGS" not in env}


def child(n_layer: int, repeats: int) -> None:
    """In the measured process: print the median of `repeats` fresh compiles (XLA's part, not the trace)."""
    from bench.gpt_compile import compile_seconds
    from models import gpt

    config = gpt.GPTConfig(64, vocab_size=65, n_layer=n_layer, n_head=4, n_embd=128)
    print(json.dumps(statistics.median(compile_seconds(config)[1] for _ in range(repeats))))


def measure(n_layer: int, repeats: int) -> dict[str, float]:
    """Each setting's median compile seconds, each in a fresh process with no compilation cache."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    base.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false", PYTHONPATH=str(ROOT))
    out = {}
    for name, env in settings().items():
        command = [sys.executable, "-m", "bench.suite_compile", "--child", str(n_layer), str(repeats)]
        done = subprocess.run(command, env={**base, **env}, capture_output=True, text=True, cwd=ROOT, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--child", type=int, nargs=2, metavar=("N_LAYER", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child)
    seconds = measure(args.n_layer, args.repeats)
    print(f"jaxlib {version('jaxlib')}, n_layer {args.n_layer}, median of {args.repeats} compiles per setting")
    print(f"{'setting':24s} {'compile s':>10s} {'x defaults':>11s}")
    for name, value in seconds.items():
        print(f"{name:24s} {value:10.2f} {value / seconds['defaults']:11.2f}")


if __name__ == "__main__":
    main()
