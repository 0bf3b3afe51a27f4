"""What each parallel mode sends over the wire, read from the compiled program, against the Megatron / ZeRO /
ring-attention / pipeline figures; the memory per device that context and pipeline parallelism save; and the
step time on 8 simulated CPU devices against one device.

    python -m bench.parallel [--repeats N] [--skip-dp2] [--tables modes,sequence,context,pipeline,memory,dp2]

Runs on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here before jax is
imported). For each mode (DP 8x1, TP 1x8, 2D 4x2, FSDP 8x1, 2D+FSDP 4x2, timed; SP 1x8, 2D+SP 4x2, EP 8x1,
2D+EP 4x2, FSDP+EP 8x1, compiled only) it compiles the full training step
(`purejax.parallel.sharded_train_step`: forward, backward, global-norm clipping, AdamW) of a GPT and sums
the elements of each kind of collective one device executes per step (bench/parallel_cases.py builds and
counts them). The "theory" column is the same quantity from the model's sizes: bench/parallel_theory.py's
docstring gives the formulas, for these modes, for context parallelism (CP n on a 1 x n ring, DP x CP on a
(dp, cp) mesh: ring attention's collective-permutes) and for pipeline parallelism (PP S,
`gpt_pipeline.sharded_loss_and_grads`: the loss and the gradients, no optimizer step; S stages, M micro-batches).

Memory per device, XLA's compiled memory analysis (`temp_size_in_bytes`, the temporaries: activations kept
for the backward pass, scores, gradients in flight). CP: the loss and gradients of long sequences, which
should fall as about 1/n (each device's scores are t x seq, not seq x seq). PP: GPipe against 1F1B, whose
buffers of kept stage inputs and received gradients hold 2 x slots micro-batch activations
(`schedules.buffer_slots`: M for GPipe, at most S for 1F1B).

Step times on CPU only show overhead: the 8 "devices" share this machine's cores and XLA's CPU thread pool,
and their collectives are memory copies, so nothing here predicts a speed-up on real accelerators. The last
table asks whether data parallelism pays on one CPU: 2 simulated devices against 1 device for the baby and
small configs of bench/gpt_train.py (same global batch) on this 2-core machine.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
from functools import partial

import jax

from bench.gpt_train import CASES
from bench.parallel_cases import (
    collectives,
    context_memory,
    context_rows,
    make_batch,
    pipeline_rows,
    sharded_step,
    single_step,
    step_rows,
)
from bench.parallel_theory import theory
from bench.timing import interleaved_medians
from models import gpt, gpt_moe
from purejax import optim
from purejax import tree as tree_lib

CONFIG = gpt.GPTConfig(block_size=64, vocab_size=128, n_layer=4, n_head=8, n_embd=128, bias=True)
BATCH = 16
MODES = {"DP": (8, 1, False), "TP": (1, 8, False), "2D": (4, 2, False), "FSDP": (8, 1, True), "2D+FSDP": (4, 2, True)}
KINDS = ("all-reduce", "all-gather", "reduce-scatter")
CONTEXT_MESHES = ((1, 2), (1, 4), (1, 8), (2, 4), (4, 2))  # (dp, cp)
PIPELINES = ((2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b"))  # (stages, schedule)
MICRO_BATCHES = 8
# the memory table's long sequences: 2 layers, n_embd 64, 4 heads, 2 sequences of 1024 tokens
LONG = gpt.GPTConfig(block_size=1024, vocab_size=128, n_layer=2, n_head=4, n_embd=64, bias=True)
LONG_BATCH = 2
# (dp, tp, fsdp, sp, ep)
SEQUENCE_MODES = {"SP": (1, 8, False, True, False), "2D+SP": (4, 2, False, True, False)}
EXPERT_MODES = {
    "EP": (8, 1, False, False, True),
    "2D+EP": (4, 2, False, False, True),
    "FSDP+EP": (8, 1, True, False, True),
}
MOE = gpt_moe.MoEConfig(**dataclasses.asdict(CONFIG), n_experts=8)
STEP_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
TABLES = ("modes", "sequence", "context", "pipeline", "memory", "dp2")


def time_steps(steps: list, states: list, batch, repeats: int) -> list[float]:
    """Median seconds per step, interleaved; each contender keeps stepping its own state (donated)."""
    holders = [[s] for s in states]

    def runner(step, holder):
        def run(batch):
            holder[0], metrics = step(holder[0], batch)
            return metrics["loss"]

        return run

    return interleaved_medians([runner(s, h) for s, h in zip(steps, holders)], (batch,), repeats, iters=1)


def modes_table(repeats: int) -> None:
    params = gpt.init(jax.random.key(0), CONFIG)
    optimizer = optim.adamw(1e-3, weight_decay=0.1)
    batch = make_batch(CONFIG, BATCH)
    single, single_state = single_step(CONFIG, params, optimizer)
    print()
    print("| mode | mesh | all-reduce: ops, KiB/device (theory) | all-gather | reduce-scatter | step ms (1 device) |")
    print("|---|---|---|---|---|---|")
    for name, (dp, tp, fsdp) in MODES.items():
        step, state, specs, mesh = sharded_step(CONFIG, params, optimizer, dp, tp, fsdp)
        got = collectives(step.lower(state, batch).compile().as_text(), mesh.shape)
        want = theory(CONFIG, specs, dp, tp, fsdp, batch=BATCH)
        cells = [
            f"{got.get(k, (0, 0))[0]}, {got.get(k, (0, 0))[1] * 4 / 1024:.1f} ({want[k] * 4 / 1024:.1f})" for k in KINDS
        ]
        sharded_s, single_s = time_steps([step, single], [state, single_state], batch, repeats)
        print(f"| {name} | {dp}x{tp} | {' | '.join(cells)} | {sharded_s * 1e3:.1f} ({single_s * 1e3:.1f}) |")


def dp2_table(repeats: int) -> None:
    print("\nData parallel over 2 simulated devices against 1 device, same global batch (bench/gpt_train.py configs)\n")
    print("| config | batch | 1 device ms | DP 2 devices ms | DP / 1 device |")
    print("|---|---|---|---|---|")
    for name in ("baby", "small"):
        case = CASES[name]
        config = dataclasses.replace(case.model, vocab_size=66 if case.model.vocab_size % 2 else case.model.vocab_size)
        params = gpt.init(jax.random.key(0), config)
        optimizer = optim.adamw(1e-3, weight_decay=0.1)
        batch = make_batch(config, case.batch)
        single, single_state = single_step(config, params, optimizer)
        step, state, _, _ = sharded_step(config, params, optimizer, 2, 1, False, jax.devices()[:2])
        dp_s, single_s = time_steps([step, single], [state, single_state], batch, repeats)
        print(f"| {name} | {case.batch} | {single_s * 1e3:.1f} | {dp_s * 1e3:.1f} | {dp_s / single_s:.2f}x |")


def cell(got: tuple[int, int], want: tuple | None) -> str:
    """`ops (theory), KiB (theory)` of one kind of collective, float32; the theory's ops left out where it has none."""
    want_ops, want_elements = want if want is not None else (0, 0)
    ops = f"{got[0]}" if want_ops is None else f"{got[0]} ({want_ops})"
    return f"{ops}, {got[1] * 4 / 1024:.1f} ({want_elements * 4 / 1024:.1f})"


def collective_cells(row: dict, kinds=("collective-permute", "all-reduce")) -> list[str]:
    """The cells of a row for each of `kinds`, then every other kind it executes (none expected)."""
    got, want = row["got"], row["theory"]
    others = sorted(k for k in set(got) | set(want) if k not in kinds and got.get(k))
    main_cells = [cell(got.get(k, (0, 0)), want.get(k)) for k in kinds]
    return [*main_cells, "; ".join(f"{k}: {cell(got[k], want.get(k))}" for k in others) or "none"]


def sequence_experts_table() -> None:
    print(
        f"\nSequence and expert parallelism: the training step as above; EP on the same GPT with every MLP a "
        f"mixture of {MOE.n_experts} experts (top {MOE.expert_top_k}, capacity factor {MOE.capacity_factor}), "
        f"{tree_lib.count(gpt.init(jax.random.key(0), MOE)):,} params\n"
    )
    print(f"| mode | mesh | {' | '.join(f'{k}: ops, KiB/device (theory)' for k in STEP_KINDS)} | other |")
    print("|---|---|" + "---|" * (len(STEP_KINDS) + 1))
    for row in step_rows(CONFIG, BATCH, SEQUENCE_MODES) + step_rows(MOE, BATCH, EXPERT_MODES):
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(collective_cells(row, STEP_KINDS))} |")


def context_table() -> None:
    print(f"\nContext parallelism: the training step, each sequence split over a ring (zig-zag), batch {BATCH}\n")
    print("| mode | mesh (dp x cp) | collective-permute: ops (theory), KiB/device (theory) | all-reduce | other |")
    print("|---|---|---|---|---|")
    for row in context_rows(CONFIG, BATCH, CONTEXT_MESHES):
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(collective_cells(row))} |")


def pipeline_table() -> None:
    print(
        f"\nPipeline parallelism: the loss and gradients (no optimizer step), batch {BATCH}, "
        f"{MICRO_BATCHES} micro-batches\n"
    )
    print(
        "| mode | pipeline | collective-permute: ops (theory), KiB/device (theory) | all-reduce | other "
        "| temp KiB/device | buffers KiB (2 x slots x micro-batch) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in pipeline_rows(CONFIG, BATCH, MICRO_BATCHES, PIPELINES):
        cells = [*collective_cells(row), f"{row['temp_bytes'] / 1024:.1f}", f"{row['buffer_bytes'] / 1024:.1f}"]
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(cells)} |")


def memory_table() -> None:
    memory = context_memory(LONG, LONG_BATCH)
    print(
        f"\nContext parallelism, temporaries per device of the loss and gradients (XLA's memory analysis): GPT "
        f"n_layer={LONG.n_layer} n_head={LONG.n_head} n_embd={LONG.n_embd}, {LONG_BATCH} sequences of "
        f"{LONG.block_size} tokens\n"
    )
    print("| cp | " + " | ".join(str(cp) for cp in memory) + " |")
    print("|---|" + "---|" * len(memory))
    print("| MiB per device | " + " | ".join(f"{b / 2**20:.1f}" for b in memory.values()) + " |")
    print("| of cp=1's (1/cp) | " + " | ".join(f"{b / memory[1]:.2f} (1/{cp})" for cp, b in memory.items()) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-dp2", action="store_true", help="leave out the 2-device data-parallel table")
    parser.add_argument("--tables", default=",".join(TABLES), help=f"which tables, comma-separated, of {TABLES}")
    args = parser.parse_args(argv)
    tables = [t for t in args.tables.split(",") if t and not (t == "dp2" and args.skip_dp2)]
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        parser.error(f"--tables: unknown {unknown}; choose from {TABLES}")
    assert jax.device_count() == 8, jax.devices()
    print(
        f"jax {jax.__version__}, {jax.device_count()} simulated {jax.default_backend()} devices, {os.cpu_count()} cores"
    )
    n_params = tree_lib.count(jax.eval_shape(partial(gpt.init, config=CONFIG), jax.random.key(0)))
    print(
        f"GPT n_layer={CONFIG.n_layer} n_head={CONFIG.n_head} n_embd={CONFIG.n_embd} block={CONFIG.block_size} "
        f"vocab={CONFIG.vocab_size}, batch {BATCH}, {n_params:,} params, float32 (4 bytes/element)"
    )
    if "modes" in tables:
        modes_table(args.repeats)
    if "sequence" in tables:
        sequence_experts_table()
    if "context" in tables:
        context_table()
    if "pipeline" in tables:
        pipeline_table()
    if "memory" in tables:
        memory_table()
    if "dp2" in tables:
        dp2_table(args.repeats)


if __name__ == "__main__":
    main()
