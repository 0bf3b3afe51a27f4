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


def measure_matmul_flops(n: int = 1024, seconds: float = 0.5) -> float:
    """This machine's float32 matmul rate (FLOP/s) for an n x n matmul under jit, over about `seconds`: the
    benchmarks' compute roof on a CPU (the best of several, taken in the same run as what it is set against;
    the training programs report no MFU on a CPU, since the rate moves with the machine's load)."""
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a).block_until_ready()
        calls += 1
    return 2 * n**3 * calls / (time.perf_counter() - start)
