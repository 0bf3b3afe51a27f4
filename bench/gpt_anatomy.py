"""Where the GPT training step of bench/gpt_train.py spends its time on XLA:CPU, measured.

    python -m bench.gpt_anatomy [--configs baby,small] [--sections profile,dots,attention,step,remat,flags]

Sections (each prints a markdown table; docs/benchmarks.md records them):
    profile    purejax, raw JAX and NNX (split mode) side by side: the step time (interleaved medians), then one
               profiled step per contender (jax.profiler, XLA:CPU's per-thunk trace events) with the busy time
               by kind of kernel: matmuls (YNNPACK fusions and Eigen dots), layout changes (fusions whose output
               is a transpose, copies), other elementwise/reduction fusions; and from the optimized HLO the
               number of transposes and copies and the bytes they write.
    dots       every dot of purejax's optimized step HLO (shapes, contracting dims and the physical layouts
               they are stored in), timed as a standalone jitted dot and as the same product in PyTorch
               (2 threads), times how often the step runs it; against the profiled time of the step's matmuls.
    attention  purejax with `jax.nn.dot_product_attention` ("fused") against the einsum formulation.
    step       forward only, forward + backward and the full step, purejax against NNX split; and purejax's
               step without donation, with the optimizer as one fused tree_map, with the layer scan unrolled,
               and with the matmuls in their former 3-D form (`x @ w` on (batch, seq, d) activations, before
               this investigation moved purejax to purejax/nn/_matmul.py's row form).
    remat      purejax's step with its blocks scanned or looped, under each rematerialisation choice
               (purejax/nn/remat.py: `jax.checkpoint` of the whole block, or a `jax.checkpoint_policies` policy),
               against the default (`layers="auto"`) and the plain scan: step time and XLA's scratch memory.
    flags      the XLA:CPU flags this jaxlib knows (strings of libjax_common.so), and the purejax step timed in
               a subprocess under each promising one (XLA_FLAGS is read once, when the backend starts), with the
               loss after two steps, to see whether a flag changes the numerics.

Timings share the machine with other jobs: each table reports the load average; compare ratios within one
table, not absolute times across runs. The default run does baby and small, every section.
"""

import argparse
import collections
import os
import statistics
import time
from functools import partial

import jax
import numpy as np

from bench import gpt_train, gpt_train_cases
from bench.gpt_anatomy_flags import section_flags, worker
from bench.gpt_anatomy_hlo import DUMP_FLAGS, KINDS, build_with_hlo, movement, step_dots
from bench.gpt_anatomy_profile import profile, time_dots, torch_profile
from bench.gpt_anatomy_steps import (
    Setup,
    make_nnx_part,
    make_purejax_3d,
    make_purejax_part,
    make_purejax_unrolled,
    make_purejax_variant,
    medians,
    table,
    traced_in,
)
from bench.gpt_train_nnx import make_nnx
from bench.gpt_train_purejax import make_purejax
from bench.gpt_train_raw import make_raw

CONFIGS = tuple(n + bias for n in ("tiny", "baby", "small", "small-b16") for bias in ("", gpt_train_cases.BIAS_SUFFIX))
SECTIONS = ("profile", "dots", "attention", "step", "remat", "flags")
# The rematerialisation choices the remat section times on the scanned blocks (purejax/nn/remat.py's names).
REMATS = ("block", "dots_saveable", "dots_with_no_batch_dims_saveable")

PROFILED = {
    "purejax-3d": make_purejax_3d,
    "purejax": make_purejax,
    "purejax-unrolled": make_purejax_unrolled,
    "raw": make_raw,
    "nnx-split": partial(make_nnx, mode="split"),
}


def section_profile(setup: Setup, repeats) -> dict:
    """Step times, profiled busy time by kind, and data movement in the HLO, for PROFILED. Returns the steps
    and HLO texts for the later sections."""
    built = {name: build_with_hlo(setup.build, make) for name, make in PROFILED.items()}
    losses = {name: float(step()) for name, (step, _) in built.items()}
    # One update since the first (compiling) call: purejax-3d is the same maths (float32 rounding apart); the
    # peers' AdamW differs in where epsilon and clipping sit (bench/gpt_train.py checks them more closely).
    for name, loss in losses.items():
        rtol = 1e-5 if name.startswith("purejax") else 1e-3
        np.testing.assert_allclose(loss, losses["purejax"], rtol=rtol, err_msg=f"{setup.name}: {name}'s loss differs")
    ms = medians({name: step for name, (step, _) in built.items()}, setup, repeats)
    # Profiles in rounds, every contender once per round, and per kind the median over the rounds: a burst of
    # other jobs then spoils one round's figures, not one contender's.
    rounds = [{name: profile(step, hlo, steps=2) for name, (step, hlo) in built.items()} for _ in range(3)]
    rows = []
    for name, (_step, hlo) in built.items():
        busy = {k: statistics.median(r[name].get(k, 0.0) for r in rounds) for k in (*KINDS, "wall", "thunks")}
        moved = movement(hlo)
        total = sum(busy.get(k, 0.0) for k in KINDS)
        rows.append(
            [
                name,
                f"{ms[name]:.1f}",
                f"{ms[name] / ms['purejax']:.2f}",
                f"{busy['wall']:.1f}",
                *(f"{busy.get(k, 0.0):.1f}" for k in KINDS),
                f"{total:.1f}",
                f"{busy['thunks']:.0f}",
                " + ".join(f"{n} {kind}" for kind, (n, _) in sorted(moved.items())) or "0",
                f"{sum(b for _, b in moved.values()) / 2**20:.1f}",
            ]
        )
    print(f"\n### {setup.name}: where the step's time goes (ms per step; busy = summed over XLA's threads)")
    table(
        (
            "contender",
            "step ms",
            "/ purejax",
            "profiled ms",
            *KINDS,
            "busy total",
            "kernels run",
            "movement ops in HLO",
            "their MiB",
        ),
        rows,
    )
    return built


def section_dots(setup: Setup, built: dict, repeats: int) -> None:
    """purejax's matmuls timed one by one in XLA and torch; totals against the profiled step."""
    rows, totals = [], collections.Counter()
    for contender in ("purejax-3d", "purejax"):
        dots = step_dots(built[contender][1], setup.case.model.n_layer)
        times = time_dots(list(dots), repeats)
        for (dot, runs), (xla, torch_s) in zip(dots.items(), times):
            totals[contender, "xla"] += xla * runs * 1e3
            totals[contender, "torch"] += torch_s * runs * 1e3
            totals[contender, "gflop"] += dot.flops * runs / 1e9
            if contender == "purejax":
                rows.append(
                    [
                        dot.describe(),
                        dot.kernel,
                        runs,
                        f"{xla * 1e6:.0f}",
                        f"{torch_s * 1e6:.0f}",
                        f"{dot.flops / xla / 1e9:.0f}",
                        f"{dot.flops / torch_s / 1e9:.0f}",
                    ]
                )
    print(f"\n### {setup.name}: purejax's matmuls alone (dims in memory order, k = contracted, b = batch)")
    table(("dot", "XLA kernel", "runs / step", "XLA us", "torch us", "XLA GFLOP/s", "torch GFLOP/s"), rows)
    tp = torch_profile(setup)
    print(f"\n### {setup.name}: matmul totals per step (ms)")
    table(
        ("step", "GFLOP", "XLA dots alone", "same dots in torch", "torch / XLA"),
        [
            [
                c,
                f"{totals[c, 'gflop']:.2f}",
                f"{totals[c, 'xla']:.1f}",
                f"{totals[c, 'torch']:.1f}",
                f"{totals[c, 'torch'] / totals[c, 'xla']:.2f}",
            ]
            for c in ("purejax-3d", "purejax")
        ],
    )
    print(
        f"torch eager step under its profiler: {tp['wall']:.1f} ms, of which matmul kernels {tp['matmul']:.1f} ms"
        f" and attention kernels {tp['attention']:.1f} ms"
    )


def section_attention(setup: Setup, repeats) -> None:
    """purejax with the fused attention against the einsum formulation, and the same with 3-D matmuls."""
    steps = {
        "fused": setup.build(make_purejax, attention_impl="fused"),
        "einsum": setup.build(make_purejax, attention_impl="einsum"),
        "3-D matmuls, fused": setup.build(make_purejax_3d, attention_impl="fused"),
        "3-D matmuls, einsum": setup.build(make_purejax_3d, attention_impl="einsum"),
    }
    losses = {name: float(step()) for name, step in steps.items()}
    ms = medians(steps, setup, repeats)
    print(f"\n### {setup.name}: attention formulation (purejax step)")
    table(
        ("attention", "step ms", "/ fused", "first loss"),
        [[n, f"{ms[n]:.1f}", f"{ms[n] / ms['fused']:.2f}", f"{losses[n]:.7f}"] for n in steps],
    )


def section_step(setup: Setup, repeats) -> None:
    """fwd, fwd+bwd and the full step for purejax and NNX; purejax's step variants."""
    parts = {}
    for part in ("fwd", "fwd+bwd"):
        parts[f"purejax {part}"] = setup.build(partial(make_purejax_part, part=part))
        parts[f"nnx {part}"] = setup.build(partial(make_nnx_part, part=part))
        parts[f"purejax-3d {part}"] = traced_in(setup.build(partial(make_purejax_part, part=part)), matmuls_3d=True)
    steps = {
        "purejax step": setup.build(make_purejax),
        "nnx step (split)": setup.build(partial(make_nnx, mode="split")),
        "purejax-3d step": setup.build(make_purejax_3d),
        "purejax step, no donation": setup.build(partial(make_purejax_variant, donate=False)),
        "purejax step, fused AdamW": setup.build(partial(make_purejax_variant, optimizer="fused")),
        "purejax step, scan unrolled": setup.build(make_purejax_unrolled),
        "purejax step, loop": setup.build(make_purejax, layers="loop"),
    }
    ms = medians({**parts, **steps}, setup, repeats)
    print(f"\n### {setup.name}: forward, backward, the step around them (ms)")
    rows = []
    for name, v in ms.items():
        base = "purejax " + name.rsplit(" ", 1)[1] if name.endswith(("fwd", "bwd")) else "purejax step"
        rows.append([name, f"{v:.1f}", f"{v / ms[base]:.2f}"])
    table(("what", "ms", "/ purejax's same part"), rows)


def section_remat(setup: Setup, repeats) -> None:
    """The default step, the plain scan, and the scan and the loop with each of REMATS: time, scratch memory
    (XLA's temporaries, compile only), and the first loss (rematerialisation must not change it)."""
    steps = {"default (auto)": setup.build(make_purejax), "scan": setup.build(make_purejax, layers="scan")}
    for layers in ("scan", "loop"):
        for remat in REMATS:
            steps[f"{layers}, {remat}"] = setup.build(make_purejax, layers=layers, remat=remat)
    losses = {name: float(step()) for name, step in steps.items()}
    scratch = {name: step.scratch_bytes() / 2**20 for name, step in steps.items()}
    ms = medians(steps, setup, repeats)
    print(f"\n### {setup.name}: rematerialisation of the blocks, scanned or looped (purejax step)")
    rows = [[n, f"{ms[n]:.1f}", f"{ms[n] / ms['scan']:.2f}", f"{scratch[n]:.1f}", f"{losses[n]:.7f}"] for n in steps]
    table(("blocks", "step ms", "/ scan", "scratch MiB", "first loss"), rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="baby,small", help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved samples (default: gpt_train's + 2)")
    parser.add_argument("--flag-configs", default="baby", help="configs the flags section times (default: baby)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.repeats)
    configs, sections = args.configs.split(","), args.sections.split(",")
    for kind, given, valid in (("config", configs, CONFIGS), ("section", sections, SECTIONS)):
        unknown = [g for g in given if g not in valid]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")
    if jax.config.jax_platforms not in (None, "", "cpu"):
        parser.error("this investigation is about XLA:CPU; run with JAX_PLATFORMS=cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DUMP_FLAGS}"  # before the backend starts
    start = time.perf_counter()
    print(f"{gpt_train.versions()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    for name in configs:
        setup = Setup.make(name)
        built = section_profile(setup, args.repeats) if {"profile", "dots"} & set(sections) else None
        if "dots" in sections:
            section_dots(setup, built, args.repeats or 5)
        if "attention" in sections:
            section_attention(setup, args.repeats)
        if "step" in sections:
            section_step(setup, args.repeats)
        if "remat" in sections:
            section_remat(setup, args.repeats)
    if "flags" in sections:
        section_flags(args.flag_configs.split(","), args.repeats)
    print(f"\ntotal {time.perf_counter() - start:.0f}s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
