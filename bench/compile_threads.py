"""Do two programs compile faster side by side, on two threads, than one after the other? The wall and CPU
seconds XLA takes to compile GPT training steps (bench/gpt_compile.py's program) one at a time and two at once.

    python -m bench.compile_threads [--repeats 3] [--n_layer 2]

A training program could compile its step on a background thread while it builds its state and runs its
first evaluation, and reach its first step sooner (docs/benchmarks.md, "Time to the first step"). That pays
only where the compiler leaves cores idle: when one compilation already keeps every core busy (CPU seconds
about the wall seconds times the cores), two at once take as long as two in a row. Every compilation here
is of a program not compiled before in the process (each its own vocabulary size), with JAX's persistent
cache off; the figures are medians over --repeats.
"""

import argparse
import itertools
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable

import jax

from bench.gpt_compile import lower_step
from models import gpt

_vocab_sizes = itertools.count(65)  # a new program for every compilation


def lowered_step(n_layer: int) -> jax.stages.Lowered:
    """`bench.gpt_compile.lower_step`'s program (4 heads, width 128, block 64, batch 8), lowered, not compiled;
    a vocabulary size never used before makes it a new program."""
    config = gpt.GPTConfig(64, vocab_size=next(_vocab_sizes), n_layer=n_layer, n_head=4, n_embd=128)
    return lower_step(config)


def cpu_seconds() -> float:
    """This process's CPU seconds so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(
    compile_all: Callable[[list[jax.stages.Lowered]], None], programs: list[jax.stages.Lowered]
) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `compile_all(programs)`."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    compile_all(programs)
    return time.perf_counter() - wall, cpu_seconds() - cpu


def one_after_the_other(programs: list[jax.stages.Lowered]) -> None:
    """Compile each program in turn, on this thread."""
    for program in programs:
        program.compile()


def side_by_side(programs: list[jax.stages.Lowered]) -> None:
    """Compile every program at once, each on a thread of its own."""
    threads = [threading.Thread(target=program.compile) for program in programs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def measure(n_layer: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{"one": ..., "two in a row": ..., "two side by side": ...}: median (wall s, CPU s) of each."""
    ways = {
        "one": (one_after_the_other, 1),
        "two in a row": (one_after_the_other, 2),
        "two side by side": (side_by_side, 2),
    }
    samples = {name: [] for name in ways}
    for _ in range(repeats):
        for name, (compile_all, count) in ways.items():
            samples[name].append(timed(compile_all, [lowered_step(n_layer) for _ in range(count)]))
    return {name: tuple(statistics.median(s[i] for s in rows) for i in (0, 1)) for name, rows in samples.items()}


def main(argv=None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n_layer", type=int, default=2)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    results = measure(args.n_layer, args.repeats)
    print("| compiled | wall s | CPU s | CPU / wall |\n|---|---:|---:|---:|")
    for name, (wall, cpu) in results.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {cpu / wall:.2f} |")
    return results


if __name__ == "__main__":
    main()
