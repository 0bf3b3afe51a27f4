"""Timing for the benchmarks: medians of interleaved samples, so that machine noise (other processes, CPU
frequency changes) hits every contender alike rather than whichever happened to run during it."""

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def interleaved_medians(
    fns: Sequence[Callable], args: tuple[Any, ...], repeats: int, iters: int | None = None, sample_seconds: float = 0.05
) -> list[float]:
    """Median seconds per call of each fn on `args`, sampled A, B, A, B, ... after one warm-up call each.

    Each sample times `iters` back-to-back calls (default: enough calls of the first fn to last about
    `sample_seconds`) and blocks once at the end, so dispatch overlaps computation as in a training loop."""
    for f in fns:
        jax.block_until_ready(f(*args))
    if iters is None:
        start = time.perf_counter()
        jax.block_until_ready(fns[0](*args))
        iters = max(1, int(sample_seconds / (time.perf_counter() - start)))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, s in zip(fns, samples):
            start = time.perf_counter()
            for _ in range(iters):
                out = f(*args)
            jax.block_until_ready(out)
            s.append((time.perf_counter() - start) / iters)
    return [statistics.median(s) for s in samples]
