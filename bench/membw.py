"""This machine's memory bandwidth: how fast numpy and XLA stream an array much larger than the caches.

    python -m bench.membw [--mib 512] [--repeats 7]

A cached decoding step reads every parameter and the whole key/value cache once and does little arithmetic
with each byte, so its memory floor is bytes / read bandwidth; bench/gpt_generate.py reports each step against
the roofline, the larger of that and FLOPs / matmul rate (`bench.timing.measure_matmul_flops`).
Two kernels, each the best of `repeats` runs (the best, not the median: the floor is what the memory can do
when nothing else is in the way):

- read: the sum of a float32 array, `a.sum()` in numpy and in XLA (jit). Bytes counted: the array, once.
- copy: `np.copyto(b, a)` and XLA's `a + 1.0` written over its donated input (a fresh 512 MiB buffer per call
  would time the page faults). Bytes counted: read once and written once.

The decode floor uses the larger read figure: XLA's runs on every core, numpy's sum on one.
"""

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The shortest of `repeats` timed calls, after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidths(mib: int = 512, repeats: int = 7) -> dict[str, float]:
    """GB/s (1e9 bytes per second) of each kernel on an array of `mib` MiB: {"numpy read", "numpy copy",
    "xla read", "xla copy"}."""
    n = mib * 2**20 // 4
    host = np.random.default_rng(0).random(n, dtype=np.float32)
    out = np.empty_like(host)
    device = [jnp.asarray(host)]
    read, copy = jax.jit(jnp.sum), jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def copy_in_place():
        device[0] = copy(device[0])
        return device[0]

    seconds = {
        "numpy read": best_seconds(host.sum, repeats),
        "numpy copy": best_seconds(lambda: np.copyto(out, host), repeats) / 2,  # read + write
        "xla read": best_seconds(lambda: read(device[0]), repeats),
        "xla copy": best_seconds(copy_in_place, repeats) / 2,
    }
    return {name: host.nbytes / s / 1e9 for name, s in seconds.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.mib} MiB float32, best of {args.repeats}")
    for name, gbs in bandwidths(args.mib, args.repeats).items():
        print(f"{name:12s} {gbs:6.1f} GB/s")


if __name__ == "__main__":
    main()
