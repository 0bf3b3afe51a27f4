"""One GPT training step, purejax against the same model in raw JAX, Flax NNX, Equinox, Haiku and PyTorch.

    python -m bench.gpt_train [--configs tiny,baby,small] [--bias false|true|both] [--repeats N] [--peers ...]
    python -m bench.gpt_train --configs gpt2       # GPT-2 124M on a GPU: bfloat16, MFU against the chip's peak

The step is nanoGPT's: forward, backward, global-norm gradient clipping at 1.0, then AdamW (betas 0.9/0.99,
weight decay 0.1 on tensors with ndim >= 2 only, warmup + cosine learning rate), no dropout, in `--dtype`
("auto": float32 on a CPU, bfloat16 compute with float32 weights and optimizer state on a GPU or TPU), on
nanoGPT's architecture (learned positions, pre-LayerNorm blocks, fused qkv causal attention, 4x MLP with exact
GELU, final LayerNorm, weight-tied head), without biases (nanoGPT's bias=False) or, `--bias true` (configs
labelled "tiny-bias", ...), with GPT-2's biases in every linear layer and LayerNorm; `--bias both` runs each
config both ways. Every contender is built from the SAME initial weights (purejax's `gpt.init`, its LayerNorm
scales and all biases then moved off their 1 and 0 by a fixed random draw, `initial_weights`, so that a peer
that dropped one would not agree; copied into each framework's modules) and fed the same batch, so before any
timing the run checks that all of them report the same loss on the first step (the initial weights) and on
the second (after one identical update).

Contenders (`--peers`, default all but raw-scan):
    purejax        models/gpt.py + purejax.optim, built exactly as train/gpt.py builds its step,
                   with GPTConfig's default `layers` (what a user gets)
    purejax-scan   the same with GPTConfig(layers="scan"): the blocks under lax.scan
    purejax-loop   the same with GPTConfig(layers="loop"): the blocks unrolled as a Python loop
    raw            jax.numpy only: a dict of params with a list of per-layer dicts, a hand-written AdamW
    raw-scan       the same maths with the blocks stacked and run under lax.scan
    nnx            Flax NNX modules, optax AdamW + clipping, `nnx.jit` (graph mode, the default)
    nnx-tree       the same with `graph=False` (NNX's tree mode: Modules handled as plain pytrees)
    nnx-split      the same model, `nnx.split` once, then a functional `jax.jit` step that merges inside
    equinox        eqx.Module GPT (one sequence at a time, vmapped over the batch), optax, `eqx.filter_jit`
    haiku          dm-haiku modules (hk.transform, a Python loop over blocks), optax, `jax.jit` with the
                   params and optimizer state donated (bench/gpt_train_haiku.py)
    torch          PyTorch eager (torch.set_num_threads(2)), torch.optim.AdamW defaults (fused on CUDA),
                   clip_grad_norm_; on the GPU when JAX runs on one, bfloat16 under torch.autocast
    torch-compile  the same with the model under torch.compile (the optimizer step stays eager)

In bfloat16 every contender computes in bfloat16 and keeps float32 weights and optimizer state; the JAX peers
ask `jax.nn.dot_product_attention` for cuDNN on a GPU (`causal_attention`) as purejax's "auto" does.

For each config and contender: the median step time (interleaved samples, bench/timing.py), tokens/s, the
time relative to purejax's, and MFU (nanoGPT's FLOPs-per-token estimate) as a fraction of the accelerator's
dense bfloat16 peak (`train.kit.peak_flops.PEAK_BF16_FLOPS`, by device kind) or, on a CPU, of this machine's
measured float32 matmul rate (`bench.timing.measure_matmul_flops`). "first s" is the first call:
tracing and compilation included. A markdown table is printed at the end.
"""

import argparse
import math
import os
import time
import traceback
from functools import partial

import jax
import numpy as np

# libgomp's default ACTIVE wait makes torch's 2 OpenMP threads spin at every barrier; on a shared 2-core machine,
# whenever another process holds a core, a tiny-config torch step then takes 50-700 ms instead of about 5.
# PASSIVE (threads sleep at barriers) avoids that. Set before torch loads libgomp; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# On a GPU, JAX would take 75% of its memory at the first op, leaving torch's peers too little: allocate on demand.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bench.gpt_train_cases import CASES, DEFAULT_PEERS, PEERS, case_batch, cases
from bench.gpt_train_equinox import make_equinox
from bench.gpt_train_haiku import make_haiku
from bench.gpt_train_nnx import make_nnx
from bench.gpt_train_purejax import make_purejax
from bench.gpt_train_raw import make_raw
from bench.gpt_train_torch import make_torch
from bench.gpt_train_weights import initial_weights
from bench.timing import interleaved_medians, measure_matmul_flops
from models import gpt_flops
from purejax.precision import resolve_compute_dtype
from train.kit import peak_flops

# Every `make_*` (one module per peer family: bench/gpt_train_purejax.py, _raw, _nnx, _equinox, _haiku, _torch)
# takes the initial weights (purejax's layout, as numpy arrays), the config and the batch (numpy), and `dtype`,
# the compute dtype, and returns `step()`: one training step on that batch, returning the loss before the update.
# The step keeps its own training state in a closure, as a training loop would.
MAKERS = {
    "purejax": make_purejax,
    "purejax-scan": partial(make_purejax, layers="scan"),
    "purejax-loop": partial(make_purejax, layers="loop"),
    "raw": make_raw,
    "raw-scan": partial(make_raw, stacked=True),
    "nnx": make_nnx,
    "nnx-tree": partial(make_nnx, mode="tree"),
    "nnx-split": partial(make_nnx, mode="split"),
    "equinox": make_equinox,
    "haiku": make_haiku,
    "torch": make_torch,
    "torch-compile": partial(make_torch, compile=True),
}


def first_losses(peer, weights, config, x, y, dtype="float32"):
    """Build `peer`'s step and take two steps: (step, (the initial weights' loss, the loss after one update),
    seconds from building to the first loss: tracing and compilation included)."""
    start = time.perf_counter()
    step = MAKERS[peer](weights, config, x, y, dtype=dtype)
    loss0 = float(step())
    first = time.perf_counter() - start
    return step, (loss0, float(step())), first


def check_agreement(name, losses, reference, dtype="float32"):
    """Every peer's (first, second) loss equals `reference`'s: same weights and batch, same maths.

    In float32 the first losses agree to float32 rounding; after one AdamW step (lr ~1e-5, the update about
    lr * sign(g)) the peers' different clipping and epsilon placement stay far below 1e-4. In bfloat16 (8 bits
    of mantissa) each framework rounds in other places: 1% is what is checked."""
    rtol = (1e-5, 1e-4) if dtype == "float32" else (1e-2, 1e-2)
    for peer, (loss0, loss1) in losses.items():
        np.testing.assert_allclose(loss0, reference[0], rtol=rtol[0], err_msg=f"{name}: {peer}'s initial loss differs")
        np.testing.assert_allclose(loss1, reference[1], rtol=rtol[1], err_msg=f"{name}: {peer}'s next loss differs")


def run_case(name, case, peers, repeats, dtype="float32"):
    """Build every contender, check that their first two losses agree, time them interleaved. Returns per peer
    (median step seconds, first call seconds), or the error message of a peer that could not run."""
    config = case.model
    weights, (x, y) = initial_weights(config), case_batch(case)
    print(f"\n{name}: {config}, batch {case.batch}", flush=True)

    steps, losses, first, failed = {}, {}, {}, {}
    for peer in peers:
        try:
            steps[peer], losses[peer], first[peer] = first_losses(peer, weights, config, x, y, dtype)
            print(
                f"  {peer:14s} first call {first[peer]:6.2f}s, losses {losses[peer][0]:.7f} {losses[peer][1]:.7f}",
                flush=True,
            )
        except Exception as e:  # a peer that cannot run here (e.g. torch.compile without a compiler) is reported
            failed[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"  {peer:14s} FAILED: {failed[peer]}", flush=True)
            traceback.print_exc(limit=3)

    reference = losses.get("purejax") or next(iter(losses.values()))
    check_agreement(name, losses, reference, dtype)
    # Near-uniform logits at init: the tied head's have std ~0.02 * sqrt(n_embd), which lifts the loss above
    # ln(vocab) by about half their variance (measured 0.15 at GPT-2's n_embd 768, 0.06 at 384): 5% of ln(vocab)
    # passes those and still fails broken weights.
    ln_vocab = math.log(config.vocab_size)
    assert abs(reference[0] / ln_vocab - 1) < 0.05, (
        f"{name}: initial loss {reference[0]} is not ~ln(vocab) = {ln_vocab}"
    )

    timed = list(steps)
    iters = None if case.sample_seconds else 1
    seconds = interleaved_medians(
        [steps[p] for p in timed], (), repeats or case.repeats, iters=iters, sample_seconds=case.sample_seconds or 0.05
    )
    return {peer: (seconds[timed.index(peer)], first[peer]) if peer in steps else failed[peer] for peer in peers}


def table_rows(name, case, results, peak):
    """Markdown cells per peer: a failure's message, or step ms, tokens/s, time / purejax, MFU, first call s."""
    tokens = case.batch * case.model.block_size
    base = results["purejax"][0] if isinstance(results.get("purejax"), tuple) else None
    for peer, result in results.items():
        if isinstance(result, str):
            yield name, peer, "failed", "", "", "", "", result
            continue
        s, first = result
        mfu = gpt_flops.estimate_mfu(case.model, tokens / s, peak)
        ratio = f"{s / base:.2f}" if base else ""
        yield name, peer, f"{s * 1e3:.2f}", f"{tokens / s:,.0f}", ratio, f"{mfu:.1%}", f"{first:.1f}", ""


def versions() -> str:
    out = [f"jax {jax.__version__}"]
    for module in ("flax", "equinox", "haiku", "optax", "torch"):
        try:
            out.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            out.append(f"{module} not installed")
    return ", ".join(out)


def mfu_peak(platform: str, device_kind: str, rates: list[float]) -> tuple[float, str]:
    """(FLOP/s that MFU is against, what it is): an accelerator's dense bfloat16 peak from the vendors' table
    (`peak_flops.PEAK_BF16_FLOPS`), else (a CPU, an unknown chip) the best of the float32 matmul `rates` measured
    during the run: on a shared machine, slower ones met other jobs."""
    peak = peak_flops.accelerator_peak_flops(device_kind) if platform != "cpu" else None
    if peak:
        return peak, f"{device_kind}'s dense bfloat16 peak, {peak / 1e12:.0f} TFLOP/s (the vendor's data sheet)"
    return max(rates), (
        f"the best float32 matmul rate (1024^3, jitted), 3 at the start and 3 at the end: "
        f"{', '.join(f'{r / 1e9:.0f}' for r in rates)} GFLOP/s"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,baby,small", help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument(
        "--bias",
        default="false",
        choices=("false", "true", "both"),
        help="each config without biases, with GPT-2's (labelled CONFIG-bias), or both",
    )
    parser.add_argument("--repeats", type=int, default=None, help="samples per contender (default: 9, 7, 3 by config)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="compute dtype (weights stay float32); auto: bfloat16 on a GPU/TPU, else float32",
    )
    args = parser.parse_args(argv)
    configs, peers = args.configs.split(","), args.peers.split(",")
    for kind, given, valid in (("config", configs, CASES), ("peer", peers, PEERS)):
        unknown = [g for g in given if g not in valid]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")

    dtype = resolve_compute_dtype(args.dtype, jax.default_backend())
    if jax.default_backend() == "gpu" and dtype == "float32":  # float32 as torch computes it: no TensorFloat-32
        jax.config.update("jax_default_matmul_precision", "highest")
    start = time.perf_counter()
    rates = [measure_matmul_flops() for _ in range(3)]
    load = os.getloadavg()[0]
    print(
        f"{versions()}; backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs, "
        f"load average {load:.1f}; compute dtype {dtype}"
    )
    runs = cases(configs, args.bias)
    results = {name: run_case(name, case, peers, args.repeats, dtype) for name, case in runs.items()}
    rates += [measure_matmul_flops() for _ in range(3)]
    peak, what = mfu_peak(jax.default_backend(), jax.devices()[0].device_kind, rates)
    print(f"\nMFU is against {what}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; total {time.perf_counter() - start:.0f}s\n")
    header = ("config", "peer", "step ms", "tokens/s", "time / purejax", "MFU", "first s", "note")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, rows in results.items():
        for row in table_rows(name, runs[name], rows, peak):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
