"""What each parallel mode sends over the wire, read from the compiled program, against the Megatron / ZeRO /
ring-attention / pipeline figures; the memory per device that context and pipeline parallelism save; and the
step time on 8 simulated CPU devices against one device.

    python -m bench.parallel [--repeats N] [--skip-dp2] [--tables modes,sequence,context,pipeline,memory,dp2]

Runs on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here before jax is
imported). For each mode (DP 8x1, TP 1x8, 2D 4x2, FSDP 8x1, 2D+FSDP 4x2, timed; SP 1x8, 2D+SP 4x2, EP 8x1,
2D+EP 4x2, FSDP+EP 8x1, compiled only) it compiles the full training step
(`purejax.parallel.sharded_train_step`: forward, backward, global-norm clipping, AdamW) of a GPT and sums
the elements of each kind of collective one device executes per step (tests/purejax/parallel/hlo.py counts
them: a collective in the layer scan's body counts once per layer). The "theory" column is the same
quantity from the model's sizes:

    DP     all-reduce      P + 2                           P params, 2 = the loss's sum and token count
    TP     all-reduce      4 L A + 2 A + 3 N + 2           A = batch x seq x d_model per device, N = batch x seq:
                                                           2 per block forward (g), 2 backward (f), the
                                                           vocab-parallel embedding (forward) and tied head
                                                           (backward), the cross-entropy's max, sum of exp and
                                                           label logit, the loss's two sums
    2D     all-reduce      both, with A and N per data group, and the params' local shards
    FSDP   all-gather      2 S_blocks + S_top              S: params split over data, gathered whole; blocks
                                                           twice (forward, recomputed backward)
           + with TP       + L A                           the recomputed block repeats its attention psum
           reduce-scatter  S / D                           each device keeps 1/D of the split gradients
           all-reduce      P - S + 2                       the replicated vectors' gradients
    SP     all-gather      (4 L + 2) A                     Megatron sequence parallelism (TP over T devices):
           reduce-scatter  (4 L + 2) A / T                 each of TP's activation all-reduces becomes an
                                                           all-gather of the whole sequence and a
                                                           reduce-scatter to this device's slice of it
           all-reduce      3 N + P_rep + 1 (+ DP's)        the cross-entropy's, the global norm's; P_rep: the
                                                           params outside the regions (LayerNorms, row-parallel
                                                           biases, wpe) saw a slice of the tokens: their
                                                           gradients summed over the model axis
    EP     all-to-all      4 L E C d                       every MLP a mixture of E experts split over data, C
                                                           slots each per device (the capacity): the slots to
                                                           the experts and back, forward and backward; 6 L
                                                           with FSDP (each block's forward recomputed)
           all-reduce      DP's (not the experts) + 2 L E + 1    the routing statistics: expert counts and
                                                           probabilities per layer, the token count once;
                                                           3 L E with FSDP (the recomputed counts)
           + with TP       each expert's MLP psums the (E, C, d) slots where the dense MLP psums A

Context parallelism (CP n on a 1 x n ring, DP x CP on a (dp, cp) mesh): the same full training step, the
batch in zig-zag ring order split over (data, context), `gpt_parallel.loss` under `MeshAxes.context`. With
t = seq / n tokens and B_d = batch / dp rows per device, d_kv = n_kv_head x head_dim:

    collective-permute  2 L (n-1) ops of 2 B_d t d_kv     ring attention: each layer's forward passes one
                                                           device's k and v block on n-1 times, and autodiff
                                                           sends their cotangents back n-1 times (remat off)
    all-reduce          P + 2                              every gradient summed over data and context, and
                                                           the loss's sum and count

Pipeline parallelism (PP S, `pipeline.sharded_loss_and_grads`: the loss and the gradients, no optimizer step;
the blocks split over S stages, the batch into M micro-batches, a schedule of T = 2 (M + S - 1) steps):

    collective-permute  2 T ops of (B / M) seq d_model    every step one activation sent forward and one
                                                           gradient back (idle steps send zeros: one program)
    all-reduce          1 op of P_shared + 1               wte, wpe and ln_f's gradients (every stage holds
                                                           them) and the loss, summed over the stages

Memory per device, XLA's compiled memory analysis (`temp_size_in_bytes`, the temporaries: activations kept
for the backward pass, scores, gradients in flight). CP: the loss and gradients of long sequences, which
should fall as about 1/n (each device's scores are t x seq, not seq x seq). PP: GPipe against 1F1B, whose
buffers of kept stage inputs and received gradients hold 2 x slots micro-batch activations
(`schedules.buffer_slots`: M for GPipe, at most S for 1F1B).

Step times on CPU only show overhead: the 8 "devices" share this machine's cores and XLA's CPU thread pool,
and their collectives are memory copies, so nothing here predicts a speed-up on real accelerators. The last
table is the issue's question: data parallelism over 2 simulated devices against 1 device for the baby and
small configs of bench/gpt_train.py (same global batch) on this 2-core machine.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
from collections import defaultdict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bench.gpt_train import CASES
from bench.timing import interleaved_medians
from purejax import optim, parallel
from purejax import tree as tree_lib
from purejax.models import gpt, gpt_parallel
from purejax.nn import moe
from purejax.parallel import context, pipeline, schedules
from tests.purejax.parallel.hlo import executed_collectives

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
MOE = dataclasses.replace(CONFIG, n_experts=8)
STEP_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
TABLES = ("modes", "sequence", "context", "pipeline", "memory", "dp2")


def collectives(hlo: str, mesh_shape) -> dict[str, tuple[int, int]]:
    """{kind: (ops executed, elements per device)} of one run of a compiled HLO module, every mesh axis together
    (`executed_collectives`: an op inside a loop's body counts once per iteration, loops nested or not)."""
    out = defaultdict(lambda: (0, 0))
    for (kind, _), counted in executed_collectives(hlo, dict(mesh_shape)).items():
        out[kind] = (out[kind][0] + counted["ops"], out[kind][1] + counted["elements"])
    return dict(out)


def theory(
    config: gpt.GPTConfig,
    specs,
    dp: int,
    tp: int,
    fsdp: bool,
    *,
    sp: bool = False,
    ep: bool = False,
    batch: int = BATCH,
) -> dict[str, int]:
    """The elements per device each collective should move, from the formulas in the module docstring."""
    shapes = tree_lib.flatten(jax.eval_shape(partial(gpt.init, config=config), jax.random.key(0)))
    specs = dict(zip(shapes, jax.tree.leaves(specs)))
    sizes = {parallel.DATA: dp, parallel.MODEL: tp}
    local = {p: int(np.prod(parallel.local_shape(s.shape, specs[p], sizes))) for p, s in shapes.items()}
    n_tokens = batch // dp * config.block_size
    a = n_tokens * config.n_embd
    slots = 0  # a MoE layer's (E, C, d) slots
    if config.n_experts:
        slots = (
            config.n_embd
            * config.n_experts
            * moe.capacity(n_tokens, config.n_experts, config.expert_top_k, config.capacity_factor or None)
        )
    # the global norm: one scalar psum per distinct set of axes the gradients are split over
    out = {"all-reduce": len({tuple(sorted(e for e in s if e)) for s in specs.values()} - {()}),
           "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}  # fmt: skip
    if tp > 1:
        # per block, forward and backward, attention's psum and the MLP's (on the slots with experts)
        activations = config.n_layer * (2 * a + 2 * (slots if config.n_experts else a)) + 2 * a
        out["all-reduce"] += 3 * n_tokens + (0 if sp else activations)
        if sp:  # each all-reduce now a reduce-scatter and an all-gather; the params outside the regions see
            # a slice of the sequence: their gradients summed over the model axis
            out["all-gather"] += activations
            out["reduce-scatter"] += activations // tp
            out["all-reduce"] += sum(n for p, n in local.items() if parallel.MODEL not in specs[p])
    if dp > 1:
        replicated = sum(n for p, n in local.items() if parallel.DATA not in specs[p])
        own = {p for p in local if ep and ".experts." in p}  # the device's own experts: never gathered or summed
        split = {p: n * dp for p, n in local.items() if parallel.DATA in specs[p] and p not in own}  # FSDP
        out["all-reduce"] += replicated + 2
        blocks = sum(n for p, n in split.items() if p.startswith("blocks."))
        out["all-gather"] += 2 * blocks + sum(split.values()) - blocks
        out["reduce-scatter"] += sum(split.values()) // dp
        if fsdp and tp > 1:  # the backward pass recomputes each block: its attention all-reduce again
            out["all-reduce"] += config.n_layer * a
        if config.n_experts:  # the routing's expert counts and probabilities, and the token count (once); the
            # block recomputed under FSDP sums the counts again (the load-balancing loss's gradient needs them)
            out["all-reduce"] += config.n_layer * (3 if fsdp else 2) * config.n_experts + 1
        if ep:  # the slots to the experts and back, forward and backward (and the recomputed forward's, FSDP)
            out["all-to-all"] += (6 if fsdp else 4) * config.n_layer * slots
    return out


def make_batch(config: gpt.GPTConfig, batch: int):
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, config.block_size + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def single_step(config: gpt.GPTConfig, params, optimizer):
    """The one-device step and its state, built as purejax/train/gpt.py builds it."""
    step = jax.jit(partial(optim.train_step, optimizer=optimizer, max_grad_norm=1.0,
                           loss_fn=lambda p, b, k: (gpt.loss(p, b, config, key=k), {})))  # fmt: skip
    return step, optim.init_train_state(params, optimizer, jax.random.key(1))


def sharded_step(
    config: gpt.GPTConfig, params, optimizer, dp: int, tp: int, fsdp: bool, devices=None, *, cp: int = 1,
    sp: bool = False, ep: bool = False,
):  # fmt: skip
    """The step on a (dp, tp) mesh, or (dp, cp, tp) with the batch's sequences split over the context axis too
    (in zig-zag ring order: `context.to_ring_order`); `sp`, `ep`: sequence and expert parallelism
    (`MeshAxes.of`). Returns the step, the placed state, the params' specs and the mesh."""
    mesh = parallel.make_mesh(dp, tp, devices, cp=cp)
    axes = parallel.MeshAxes.of(mesh, fsdp=fsdp, sp=sp, ep=ep)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    state = optim.init_train_state(params, optimizer, jax.random.key(1))
    state_specs = parallel.state_specs(state, specs)
    step = parallel.sharded_train_step(
        mesh, state_specs, P(axes.data, axes.context), optimizer=optimizer, max_grad_norm=1.0,
        loss_fn=lambda p, b, k: (gpt_parallel.loss(p, b, config, key=k, axes=axes), {}),
    )  # fmt: skip
    return step, parallel.shard(state, state_specs, mesh), specs, mesh


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
        want = theory(CONFIG, specs, dp, tp, fsdp)
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


def step_rows(config: gpt.GPTConfig, batch_size: int, modes: dict) -> list[dict]:
    """For each {name: (dp, tp, fsdp, sp, ep)} of `modes`: the collectives one device executes in a training
    step on a (dp, tp) mesh (compiled, not run) and the theory's elements (it leaves the ops to XLA)."""
    params = gpt.init(jax.random.key(0), config)
    optimizer = optim.adamw(1e-3, weight_decay=0.1)
    batch = make_batch(config, batch_size)
    rows = []
    for name, (dp, tp, fsdp, sp, ep) in modes.items():
        step, state, specs, mesh = sharded_step(config, params, optimizer, dp, tp, fsdp, sp=sp, ep=ep)
        got = collectives(step.lower(state, batch).compile().as_text(), mesh.shape)
        want = theory(config, specs, dp, tp, fsdp, sp=sp, ep=ep, batch=batch_size)
        rows.append({"mode": name, "mesh": f"{dp}x{tp}", "got": got, "theory": {k: (None, v) for k, v in want.items()}})
    return rows


def context_theory(config: gpt.GPTConfig, n_params: int, batch: int, dp: int, cp: int) -> dict[str, tuple]:
    """{kind: (ops or None where XLA decides how many, elements per device)} of a context-parallel training step,
    from the formulas in the module docstring."""
    kv_width = config.attention.n_kv_head * (config.n_embd // config.n_head)
    kv_block = 2 * (batch // dp) * (config.block_size // cp) * kv_width  # one device's k and v
    permutes = 2 * config.n_layer * (cp - 1)
    return {"collective-permute": (permutes, permutes * kv_block), "all-reduce": (None, n_params + 2)}


def context_rows(config: gpt.GPTConfig, batch_size: int, meshes=CONTEXT_MESHES) -> list[dict]:
    """For each (dp, cp) of `meshes`: the collectives one device executes in a training step on a (dp, cp)
    mesh (compiled, not run) and the theory's."""
    params = gpt.init(jax.random.key(0), config)
    optimizer = optim.adamw(1e-3, weight_decay=0.1)
    idx, targets = make_batch(config, batch_size)
    rows = []
    for dp, cp in meshes:
        devices = jax.devices()[: dp * cp]
        step, state, _, mesh = sharded_step(config, params, optimizer, dp, 1, False, devices, cp=cp)
        batch = tuple(context.to_ring_order(x, cp, zigzag=True) for x in (idx, targets))
        got = collectives(step.lower(state, batch).compile().as_text(), mesh.shape)
        want = context_theory(config, tree_lib.count(params), batch_size, dp, cp)
        rows.append({"mode": f"CP {cp}" if dp == 1 else "DP x CP", "mesh": f"{dp}x{cp}", "got": got, "theory": want})
    return rows


def pipeline_rows(config: gpt.GPTConfig, batch_size: int, n_micro: int, cases=PIPELINES) -> list[dict]:
    """For each (stages, schedule) of `cases`: the collectives one device executes in the pipelined loss and
    gradients with `n_micro` micro-batches and the theory's; XLA's temporaries per device and the part the
    schedule's buffers should take (2 x slots micro-batch activations, 4 bytes each)."""
    params = gpt.init(jax.random.key(0), config)
    batch = make_batch(config, batch_size)
    shared = tree_lib.count({name: leaf for name, leaf in params.items() if name != "blocks"})
    activation = batch_size // n_micro * config.block_size * config.n_embd  # one micro-batch, elements
    rows = []
    for n_stages, name in cases:
        mesh = jax.make_mesh((n_stages,), (pipeline.PIPE,), devices=jax.devices()[:n_stages],
                             axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
        table = schedules.SCHEDULES[name](n_stages, n_micro)
        placed = parallel.shard(params, pipeline.param_specs(params), mesh)
        compiled = pipeline.sharded_loss_and_grads(mesh, config, table).lower(placed, batch).compile()
        steps = 2 * (n_micro + n_stages - 1)
        rows.append({
            "mode": f"PP {n_stages} {name}", "mesh": f"{n_stages} stages, M={n_micro}",
            "got": collectives(compiled.as_text(), mesh.shape),
            "theory": {"collective-permute": (2 * steps, 2 * steps * activation), "all-reduce": (1, shared + 1)},
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "buffer_bytes": 2 * schedules.buffer_slots(table) * activation * 4,
        })  # fmt: skip
    return rows


def context_memory(config: gpt.GPTConfig, batch_size: int, sizes=(1, 2, 4, 8)) -> dict[int, int]:
    """{cp: XLA's temporaries in bytes per device} of the loss and gradients of `config` on a batch whose
    sequences are split over a cp-device context axis (cp = 1: one device, gpt.py's own code)."""
    params = gpt.init(jax.random.key(0), config)
    batch = make_batch(config, batch_size)
    out = {}
    for cp in sizes:
        mesh = parallel.make_mesh(1, 1, jax.devices()[:cp], cp=cp)
        axes = parallel.MeshAxes.of(mesh)
        loss_and_grads = partial(jax.value_and_grad(gpt_parallel.loss), config=config, axes=axes)
        sharded = jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(P(), P(None, axes.context)), out_specs=P())
        out[cp] = jax.jit(sharded).lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    return out


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
    print(f"\nSequence and expert parallelism: the training step as above; EP on the same GPT with every MLP a "
          f"mixture of {MOE.n_experts} experts (top {MOE.expert_top_k}, capacity factor {MOE.capacity_factor}), "
          f"{tree_lib.count(gpt.init(jax.random.key(0), MOE)):,} params\n")  # fmt: skip
    print(f"| mode | mesh | {' | '.join(f'{k}: ops, KiB/device (theory)' for k in STEP_KINDS)} | other |")
    print("|---|---|" + "---|" * (len(STEP_KINDS) + 1))
    for row in step_rows(CONFIG, BATCH, SEQUENCE_MODES) + step_rows(MOE, BATCH, EXPERT_MODES):
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(collective_cells(row, STEP_KINDS))} |")


def context_table() -> None:
    print(f"\nContext parallelism: the training step, each sequence split over a ring (zig-zag), batch {BATCH}\n")
    print("| mode | mesh (dp x cp) | collective-permute: ops (theory), KiB/device (theory) | all-reduce | other |")
    print("|---|---|---|---|---|")
    for row in context_rows(CONFIG, BATCH):
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(collective_cells(row))} |")


def pipeline_table() -> None:
    print(
        f"\nPipeline parallelism: the loss and gradients (no optimizer step), batch {BATCH}, "
        f"{MICRO_BATCHES} micro-batches\n"
    )
    print("| mode | pipeline | collective-permute: ops (theory), KiB/device (theory) | all-reduce | other "
          "| temp KiB/device | buffers KiB (2 x slots x micro-batch) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in pipeline_rows(CONFIG, BATCH, MICRO_BATCHES):
        cells = [*collective_cells(row), f"{row['temp_bytes'] / 1024:.1f}", f"{row['buffer_bytes'] / 1024:.1f}"]
        print(f"| {row['mode']} | {row['mesh']} | {' | '.join(cells)} |")


def memory_table() -> None:
    memory = context_memory(LONG, LONG_BATCH)
    print(f"\nContext parallelism, temporaries per device of the loss and gradients (XLA's memory analysis): GPT "
          f"n_layer={LONG.n_layer} n_head={LONG.n_head} n_embd={LONG.n_embd}, {LONG_BATCH} sequences of "
          f"{LONG.block_size} tokens\n")  # fmt: skip
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
