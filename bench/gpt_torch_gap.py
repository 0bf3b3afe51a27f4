"""What is left between purejax's GPT training step and PyTorch eager's on CPU, per config, and where it goes.

    python -m bench.gpt_torch_gap [--configs tiny,baby,small,small-b16] [--repeats N] [--rounds 3]

Per config (bench/gpt_train.py's cases; same initial weights and batch, the losses after one update checked
against each other first):
  1. purejax's default step (`gpt_train.make_purejax`: GPTConfig's default layers), torch eager's
     (`gpt_train.make_torch`, 2 threads) and purejax's forward + backward alone, interleaved medians
     (bench/timing.py). "torch / purejax" is the fraction of purejax's step time torch needs; 1 minus it is the
     part of purejax's time left to close. purejax's step minus its forward + backward is its clipping and AdamW.
  2. One profile of each per round (`--rounds`, medians over rounds): purejax by kind of XLA:CPU kernel
     (bench/gpt_anatomy_profile.py's `profile`: busy time per thunk, summed over XLA's threads), torch by op from
     torch.profiler's key_averages (self CPU time: `torch_kinds`). Both sides are put in the same groups
     (`GROUPS`): matmul kernels, torch's fused attention kernel (purejax's attention is inside its matmul and
     fusion rows), the rest of the kernels (elementwise, layout changes, reductions; torch's AdamW.step is there,
     shown apart), and the profiled wall time outside any kernel (dispatch, Python, idle threads). The table
     gives each group's purejax - torch and its share of the profiled gap: which kind carries the gap.

The XLA:CPU flags that might close it are timed by `python -m bench.gpt_anatomy --sections flags`.
Timings share the machine with other jobs: each table gives the load average.
"""

import argparse
import collections
import os
import statistics
import time
from functools import partial

import jax
import numpy as np

from bench import gpt_train
from bench.gpt_anatomy_hlo import DUMP_FLAGS, KINDS, build_with_hlo
from bench.gpt_anatomy_profile import profile, torch_profile_events
from bench.gpt_anatomy_steps import Setup, make_purejax_part, medians, table

CONFIGS = ("tiny", "baby", "small", "small-b16")
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::linear", "aten::matmul")
OPTIMIZER_PREFIX = "Optimizer.step#"  # torch.optim's own record_function around each step
# (group, purejax's kinds from gpt_anatomy_hlo.kind_of, torch's kinds from torch_kinds)
GROUPS = (
    ("matmul kernels", ("matmul (YNNPACK)", "matmul (Eigen)"), ("matmul",)),
    ("attention kernel", (), ("attention",)),
    ("other kernels", ("layout change", "elementwise fusion", "reduction (YNNPACK)", "other"), ("rest",)),
    ("outside kernels", ("outside",), ("outside",)),
)


def torch_kinds(events, steps: int, wall_ms: float) -> tuple[dict[str, float], collections.Counter]:
    """Milliseconds per step of torch's step by kind, from torch.profiler's `key_averages()` (`events`: items
    with `key` and the self and inclusive CPU microseconds `self_cpu_time_total`, `cpu_time_total`) over `steps`
    profiled steps taking `wall_ms` each: "matmul" (the self time of MATMUL_OPS), "attention" (every
    scaled-dot-product op and autograd node), "rest" (every other op's self time), "optimizer" (AdamW.step's
    inclusive time: its ops are also in "rest"), "kernels" (all self time), "outside" (wall minus kernels) and
    "wall".
    Also the ops of "rest" by self time, for the table's detail column."""
    out, rest = collections.Counter(), collections.Counter()
    for event in events:
        ms = event.self_cpu_time_total / 1e3 / steps
        name = event.key.lower().replace("_", "")
        if event.key in MATMUL_OPS:
            out["matmul"] += ms
        elif "scaleddotproduct" in name:
            out["attention"] += ms
        else:
            out["rest"] += ms
            rest[event.key.removeprefix("aten::")] += ms
        if event.key.startswith(OPTIMIZER_PREFIX):
            out["optimizer"] += event.cpu_time_total / 1e3 / steps
        out["kernels"] += ms
    out["outside"], out["wall"] = wall_ms - out["kernels"], wall_ms
    return dict(out), rest


def purejax_kinds(busy: dict[str, float]) -> dict[str, float]:
    """gpt_anatomy_profile.profile's result with "kernels" (its busy total over gpt_anatomy_hlo.KINDS) and "outside"
    (its profiled wall time minus that; negative when XLA ran kernels on two threads at once)."""
    kernels = sum(busy.get(k, 0.0) for k in KINDS)
    return {**busy, "kernels": kernels, "outside": busy["wall"] - kernels}


def headline(purejax_ms: float, torch_ms: float) -> tuple[float, float]:
    """(torch / purejax: the fraction of purejax's step time torch needs, 1 minus it: the part left to close)."""
    ratio = torch_ms / purejax_ms
    return ratio, 1.0 - ratio


def gap_rows(pj: dict[str, float], th: dict[str, float], torch_rest: collections.Counter) -> list[list[str]]:
    """Per group of GROUPS: purejax ms, torch ms, purejax - torch, that difference's share of the profiled gap
    (purejax's profiled wall minus torch's), and what the group holds on each side; then the profiled walls."""
    gap = pj["wall"] - th["wall"]
    rows = []
    for group, pj_kinds, th_kinds in GROUPS:
        a, b = sum(pj.get(k, 0.0) for k in pj_kinds), sum(th.get(k, 0.0) for k in th_kinds)
        detail = ", ".join(f"{k} {pj.get(k, 0.0):.1f}" for k in pj_kinds if len(pj_kinds) > 1 and pj.get(k))
        if group == "other kernels":
            top = ", ".join(f"{op} {ms:.1f}" for op, ms in torch_rest.most_common(3))
            detail += f"; torch: AdamW.step {th.get('optimizer', 0.0):.1f} (inclusive), top ops {top}"
        elif group == "attention kernel":
            detail = "purejax's attention is in its matmul and other-kernel rows"
        rows.append([group, f"{a:.1f}", f"{b:.1f}", f"{a - b:+.1f}", f"{(a - b) / gap:.0%}" if gap else "", detail])
    rows.append(["wall under the profiler", f"{pj['wall']:.1f}", f"{th['wall']:.1f}", f"{gap:+.1f}", "100%", ""])
    return rows


def median_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the rounds (a key missing in a round counts as 0)."""
    keys = {k for d in dicts for k in d}
    return {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys}


def run_config(name: str, repeats: int | None, rounds: int) -> None:
    """Build, check, time and profile one config; print its two tables."""
    setup = Setup.make(name)
    purejax, hlo = build_with_hlo(setup.build, gpt_train.make_purejax)  # its first call compiled it
    torch_step = setup.build(gpt_train.make_torch)
    torch_step()
    # After one identical update (the first calls above): gpt_train.check_agreement's tolerance.
    np.testing.assert_allclose(float(torch_step()), float(purejax()), rtol=1e-4, err_msg=f"{name}: losses differ")
    fwd_bwd = setup.build(partial(make_purejax_part, part="fwd+bwd"))
    ms = medians({"purejax": purejax, "torch": torch_step, "purejax fwd+bwd": fwd_bwd}, setup, repeats)
    ratio, left = headline(ms["purejax"], ms["torch"])
    print(f"\n### {name}: purejax's default step against torch eager (ms per step, interleaved medians)")
    table(
        (
            "purejax",
            "torch",
            "torch / purejax",
            "left to close",
            "purejax fwd+bwd",
            "purejax step - fwd+bwd (clip + AdamW)",
        ),
        [
            [
                f"{ms['purejax']:.1f}",
                f"{ms['torch']:.1f}",
                f"{ratio:.2f}",
                f"{left:.0%}" if left > 0 else "none: purejax is faster",
                f"{ms['purejax fwd+bwd']:.1f}",
                f"{ms['purejax'] - ms['purejax fwd+bwd']:.1f}",
            ]
        ],
    )
    # Profiles in rounds, each side once per round, medians per kind: a burst of other jobs spoils one round.
    pj_rounds, th_rounds, rests = [], [], []
    for _ in range(rounds):
        pj_rounds.append(purejax_kinds(profile(purejax, hlo, steps=2)))
        events, wall = torch_profile_events(torch_step, steps=2)
        kinds, rest = torch_kinds(events, 2, wall)
        th_rounds.append(kinds)
        rests.append(rest)
    th = median_dicts(th_rounds)
    print(f"\n### {name}: where the gap goes (ms per step under the profilers, medians of {rounds} rounds)")
    table(
        ("kind", "purejax", "torch", "purejax - torch", "share of the gap", "detail"),
        gap_rows(median_dicts(pj_rounds), th, rests[len(rests) // 2]),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved samples (default: gpt_train's + 2)")
    parser.add_argument("--rounds", type=int, default=3, help="profiles of each side per config (default 3)")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {', '.join(unknown)}; valid: {', '.join(CONFIGS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if jax.config.jax_platforms not in (None, "", "cpu"):
        parser.error("this comparison is about CPU; run with JAX_PLATFORMS=cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DUMP_FLAGS}"  # before the backend
    start = time.perf_counter()
    print(f"{gpt_train.versions()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    for name in configs:
        run_config(name, args.repeats, args.rounds)
    print(f"\ntotal {time.perf_counter() - start:.0f}s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
