"""Where a step's time goes, by kernel, for bench/gpt_anatomy.py and bench/gpt_torch_gap.py: one profiled XLA:CPU
step sorted by kind of kernel (`profile`, from jax.profiler's per-thunk trace events and the step's optimized
HLO), PyTorch's eager step under torch.profiler (`torch_profile_events`, `torch_profile`), and the step's dots
timed one by one, alone, in XLA and in PyTorch (`time_dots`).
"""

import collections
import glob
import os
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpt_anatomy_hlo import Dot, kind_of, parse_hlo
from bench.gpt_anatomy_steps import Setup
from bench.gpt_train_torch import make_torch
from bench.timing import interleaved_medians


def thunk_events(run, repeats: int) -> tuple[float, list[tuple[str, float]]]:
    """(wall seconds per call, [(kernel name, busy ms), ...] over all calls) of `repeats` calls of `run`, after a
    warm-up call, from XLA:CPU's per-thunk trace events (on its worker threads and the client thread)."""
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(run())
            wall = (time.perf_counter() - start) / repeats
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    events = [
        (event.name, event.duration_ns / 1e6)
        for plane in data.planes
        for line in plane.lines
        if line.name.startswith("tf_XLA")  # XLA's worker threads and the client thread that runs thunks
        for event in line.events
    ]
    return wall, events


def profile(step, hlo_text: str, steps: int = 3) -> dict[str, float]:
    """Busy milliseconds per step by kind of kernel (`kind_of`), from XLA:CPU's per-thunk trace events, and
    "wall" (ms per step under the profiler) and "thunks" (kernels run per step). Busy time sums over threads:
    with two worker threads it can exceed the wall time."""
    hlo = parse_hlo(hlo_text)
    wall, events = thunk_events(step, steps)
    busy = collections.Counter()
    thunks = 0
    for name, ms in events:
        kind = kind_of(name, hlo)
        if kind is not None:
            busy[kind] += ms / steps
            thunks += 1
    return {**busy, "wall": wall * 1e3, "thunks": thunks / steps}


def _einsum_spec(dot: Dot) -> str:
    letters = iter("abcdefghijklmnop")
    lhs = [next(letters) for _ in dot.lhs]
    rhs = [next(letters) for _ in dot.rhs]
    for a, b in zip(dot.contract[0] + dot.batch[0], dot.contract[1] + dot.batch[1]):
        rhs[b] = lhs[a]
    out = [lhs[i] for i in dot.batch[0]]
    out += [c for i, c in enumerate(lhs) if i not in dot.contract[0] + dot.batch[0]]
    out += [c for i, c in enumerate(rhs) if i not in dot.contract[1] + dot.batch[1]]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def time_dots(dots, repeats: int) -> list[tuple[float, float]]:
    """(XLA seconds, torch seconds) per call of each dot: the jitted `lax.dot_general` on arrays stored as the
    step stores them, and `torch.einsum` of the same (2 threads; einsum hands the strided operands to its
    batched matmul, copying them only if it must), interleaved."""
    import torch

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    fns = []
    for dot in dots:
        a, b = (rng.standard_normal(s, np.float32) for s in (dot.lhs, dot.rhs))
        xla = jax.jit(partial(jax.lax.dot_general, dimension_numbers=(dot.contract, dot.batch)))
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        spec = _einsum_spec(dot)
        fns += [partial(xla, ja, jb), partial(torch.einsum, spec, ta, tb)]
    seconds = interleaved_medians(fns, (), repeats, sample_seconds=0.05)
    return list(zip(seconds[::2], seconds[1::2]))


def torch_profile(setup: Setup, steps: int = 3) -> dict[str, float]:
    """Milliseconds per step of PyTorch's eager step (bench/gpt_train.py's torch peer) in its matmul kernels
    (aten::mm, bmm, addmm), its attention kernel, and in total (the step's wall time under the profiler)."""
    events, wall = torch_profile_events(setup.build(make_torch), steps)
    out = collections.Counter()
    for event in events:
        if event.key in ("aten::mm", "aten::bmm", "aten::addmm"):
            out["matmul"] += event.self_cpu_time_total / 1e3 / steps
        elif "scaled_dot_product" in event.key:  # forward and backward kernels
            out["attention"] += event.self_cpu_time_total / 1e3 / steps
    return {**out, "wall": wall}


def torch_profile_events(step, steps: int):
    """(torch.profiler's key_averages over `steps` calls of `step` after one warm-up call, ms per step under the
    profiler)."""
    import torch

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    return prof.key_averages(), wall * 1e3
