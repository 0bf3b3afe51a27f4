"""What each parallel mode sends over the wire, read from the compiled program, against the Megatron / ZeRO
figures; and the step time on 8 simulated CPU devices against one device.

    python -m bench.parallel [--repeats N] [--skip-dp2]

Runs on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here before jax is
imported). For each mode (DP 8x1, TP 1x8, 2D 4x2, FSDP 8x1, 2D+FSDP 4x2) it compiles the full training step
(`purejax.parallel.sharded_train_step`: forward, backward, global-norm clipping, AdamW) of a GPT and sums
the elements of each kind of collective one device executes per step (a collective in the layer scan's body
counts once per layer). The "theory" column is the same quantity from the model's sizes:

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

Step times on CPU only show overhead: the 8 "devices" share this machine's cores and XLA's CPU thread pool,
and their collectives are memory copies, so nothing here predicts a speed-up on real accelerators. The last
table is the issue's question: data parallelism over 2 simulated devices against 1 device for the baby and
small configs of bench/gpt_train.py (same global batch) on this 2-core machine.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import re
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

CONFIG = gpt.GPTConfig(block_size=64, vocab_size=128, n_layer=4, n_head=8, n_embd=128, bias=True)
BATCH = 16
MODES = {"DP": (8, 1, False), "TP": (1, 8, False), "2D": (4, 2, False), "FSDP": (8, 1, True), "2D+FSDP": (4, 2, True)}
KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """{kind: (ops executed, elements per device)} of one run of a compiled HLO module. Tuple results are
    summed element-wise; an op inside a while loop's body (the layer scan) counts once per iteration (the
    loop's known_trip_count)."""
    trips, computation, out = {}, None, {kind: [0, 0] for kind in KINDS}
    for line in hlo.splitlines():  # while ops: their body computation and trip count
        loop = re.search(r"body=(%[\w.\-]+).*known_trip_count\":\{\"n\":\"(\d+)", line)
        if loop:
            trips[loop.group(1)] = int(loop.group(2))
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split()[0] if not line.startswith("ENTRY") else "ENTRY"
        for kind in KINDS:
            op = re.search(rf"= (\(.*?\)|\S+) {kind}(?:-start)?\(", line)
            if op:
                times = trips.get(computation, 1)
                dims = re.findall(r"\[([\d,]*)\]", op.group(1))
                out[kind][0] += times
                out[kind][1] += times * sum(int(np.prod([int(x) for x in d.split(",") if x])) for d in dims)
    return {kind: tuple(v) for kind, v in out.items()}


def theory(config: gpt.GPTConfig, specs, dp: int, tp: int, fsdp: bool) -> dict[str, int]:
    """The elements per device each collective should move, from the formulas in the module docstring."""
    shapes = tree_lib.flatten(jax.eval_shape(partial(gpt.init, config=config), jax.random.key(0)))
    specs = dict(zip(shapes, jax.tree.leaves(specs)))
    sizes = {parallel.DATA: dp, parallel.MODEL: tp}
    local = {p: int(np.prod(parallel.local_shape(s.shape, specs[p], sizes))) for p, s in shapes.items()}
    n_tokens = BATCH // dp * config.block_size
    a = n_tokens * config.n_embd
    # the global norm: one scalar psum per distinct set of axes the gradients are split over
    out = {"all-reduce": len({tuple(sorted(e for e in s if e)) for s in specs.values()} - {()}),
           "all-gather": 0, "reduce-scatter": 0}  # fmt: skip
    if tp > 1:
        out["all-reduce"] += 4 * config.n_layer * a + 2 * a + 3 * n_tokens
    if dp > 1:
        split = {p: n * dp for p, n in local.items() if parallel.DATA in specs[p]}  # FSDP: gathered whole
        out["all-reduce"] += sum(n for p, n in local.items() if p not in split) + 2
        blocks = sum(n for p, n in split.items() if p.startswith("blocks."))
        out["all-gather"] = 2 * blocks + sum(split.values()) - blocks
        out["reduce-scatter"] = sum(split.values()) // dp
        if fsdp and tp > 1:  # the backward pass recomputes each block: its attention all-reduce again
            out["all-reduce"] += config.n_layer * a
    return out


def make_batch(config: gpt.GPTConfig, batch: int):
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, config.block_size + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def single_step(config: gpt.GPTConfig, params, optimizer):
    """The one-device step and its state, built as purejax/train/gpt.py builds it."""
    step = jax.jit(partial(optim.train_step, optimizer=optimizer, max_grad_norm=1.0,
                           loss_fn=lambda p, b, k: (gpt.loss(p, b, config, key=k), {})))  # fmt: skip
    return step, optim.init_train_state(params, optimizer, jax.random.key(1))


def sharded_step(config: gpt.GPTConfig, params, optimizer, dp: int, tp: int, fsdp: bool, devices=None):
    mesh = parallel.make_mesh(dp, tp, devices)
    axes = parallel.MeshAxes.of(mesh, fsdp=fsdp)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    state = optim.init_train_state(params, optimizer, jax.random.key(1))
    state_specs = parallel.state_specs(state, specs)
    step = parallel.sharded_train_step(
        mesh, state_specs, P(axes.data), optimizer=optimizer, max_grad_norm=1.0,
        loss_fn=lambda p, b, k: (gpt_parallel.loss(p, b, config, key=k, axes=axes), {}),
    )  # fmt: skip
    return step, parallel.shard(state, state_specs, mesh), specs


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
    print(
        f"\nGPT n_layer={CONFIG.n_layer} n_head={CONFIG.n_head} n_embd={CONFIG.n_embd} block={CONFIG.block_size} "
        f"vocab={CONFIG.vocab_size}, batch {BATCH}, {tree_lib.count(params):,} params, float32 (4 bytes/element)\n"
    )
    print("| mode | mesh | all-reduce: ops, KiB/device (theory) | all-gather | reduce-scatter | step ms (1 device) |")
    print("|---|---|---|---|---|---|")
    for name, (dp, tp, fsdp) in MODES.items():
        step, state, specs = sharded_step(CONFIG, params, optimizer, dp, tp, fsdp)
        got = collectives(step.lower(state, batch).compile().as_text())
        want = theory(CONFIG, specs, dp, tp, fsdp)
        cells = [f"{got[k][0]}, {got[k][1] * 4 / 1024:.1f} ({want[k] * 4 / 1024:.1f})" for k in KINDS]
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
        step, state, _ = sharded_step(config, params, optimizer, 2, 1, False, jax.devices()[:2])
        dp_s, single_s = time_steps([step, single], [state, single_state], batch, repeats)
        print(f"| {name} | {case.batch} | {single_s * 1e3:.1f} | {dp_s * 1e3:.1f} | {dp_s / single_s:.2f}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-dp2", action="store_true", help="leave out the 2-device data-parallel table")
    args = parser.parse_args(argv)
    assert jax.device_count() == 8, jax.devices()
    print(
        f"jax {jax.__version__}, {jax.device_count()} simulated {jax.default_backend()} devices, {os.cpu_count()} cores"
    )
    modes_table(args.repeats)
    if not args.skip_dp2:
        dp2_table(args.repeats)


if __name__ == "__main__":
    main()
