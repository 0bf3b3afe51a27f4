"""The cases bench/parallel.py measures: a GPT's training step built for each parallel mode (DP, TP, FSDP, SP,
EP and their 2D mixes on a (dp, tp) mesh; context parallelism on (dp, cp); a pipeline of S stages), compiled,
and the collectives one device executes read from the compiled program, each beside its theory
(bench/parallel_theory.py). Nothing here runs a step or times one: bench/parallel.py's tables do.

A row is {"mode", "mesh", "got", "theory"}: `got` {kind: (ops, elements per device)} as counted in the HLO
(tests/purejax/parallel/hlo.py: a collective in the layer scan's body counts once per layer), `theory`
{kind: (ops or None where XLA decides how many, elements per device)}.
"""

from collections import defaultdict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bench.parallel_theory import context_theory, micro_batch_activation, pipeline_theory, theory
from models import gpt, gpt_parallel, gpt_pipeline
from purejax import optim, parallel
from purejax import tree as tree_lib
from purejax.parallel import context, pipeline, pipeline_schedules
from tests.purejax.parallel.hlo import executed_collectives


def collectives(hlo: str, mesh_shape) -> dict[str, tuple[int, int]]:
    """{kind: (ops executed, elements per device)} of one run of a compiled HLO module, every mesh axis together
    (`executed_collectives`: an op inside a loop's body counts once per iteration, loops nested or not)."""
    out = defaultdict(lambda: (0, 0))
    for (kind, _), counted in executed_collectives(hlo, dict(mesh_shape)).items():
        out[kind] = (out[kind][0] + counted["ops"], out[kind][1] + counted["elements"])
    return dict(out)


def make_batch(config: gpt.GPTConfig, batch: int):
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, config.block_size + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def single_step(config: gpt.GPTConfig, params, optimizer):
    """The one-device step and its state, built as train/gpt.py builds it."""
    step = jax.jit(
        partial(
            optim.train_step,
            optimizer=optimizer,
            max_grad_norm=1.0,
            loss_fn=lambda p, b, k: (gpt.loss(p, b, config, key=k), {}),
        )
    )
    return step, optim.init_train_state(params, optimizer, jax.random.key(1))


def sharded_step(
    config: gpt.GPTConfig,
    params,
    optimizer,
    dp: int,
    tp: int,
    fsdp: bool,
    devices=None,
    *,
    cp: int = 1,
    sp: bool = False,
    ep: bool = False,
):
    """The step on a (dp, tp) mesh, or (dp, cp, tp) with the batch's sequences split over the context axis too
    (in zig-zag ring order: `context.to_ring_order`); `sp`, `ep`: sequence and expert parallelism
    (`MeshAxes.of`). Returns the step, the placed state, the params' specs and the mesh."""
    mesh = parallel.make_mesh(dp, tp, devices, cp=cp)
    axes = parallel.MeshAxes.of(mesh, fsdp=fsdp, sp=sp, ep=ep)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    state = optim.init_train_state(params, optimizer, jax.random.key(1))
    state_specs = parallel.state_specs(state, specs)
    step = parallel.sharded_train_step(
        mesh,
        state_specs,
        P(axes.data, axes.context),
        optimizer=optimizer,
        max_grad_norm=1.0,
        loss_fn=lambda p, b, k: (gpt_parallel.loss(p, b, config, key=k, axes=axes), {}),
    )
    return step, parallel.shard(state, state_specs, mesh), specs, mesh


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


def context_rows(config: gpt.GPTConfig, batch_size: int, meshes) -> list[dict]:
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


def pipeline_rows(config: gpt.GPTConfig, batch_size: int, n_micro: int, cases) -> list[dict]:
    """For each (stages, schedule) of `cases`: the collectives one device executes in the pipelined loss and
    gradients with `n_micro` micro-batches and the theory's; XLA's temporaries per device and the part the
    schedule's buffers should take (2 x slots micro-batch activations, 4 bytes each)."""
    params = gpt.init(jax.random.key(0), config)
    batch = make_batch(config, batch_size)
    shared = tree_lib.count({name: leaf for name, leaf in params.items() if name != "blocks"})
    activation = micro_batch_activation(config, batch_size, n_micro)
    rows = []
    for n_stages, name in cases:
        mesh = jax.make_mesh(
            (n_stages,), (pipeline.PIPE,), devices=jax.devices()[:n_stages], axis_types=(jax.sharding.AxisType.Auto,)
        )
        table = pipeline_schedules.SCHEDULES[name](n_stages, n_micro)
        placed = parallel.shard(params, pipeline.param_specs(params), mesh)
        compiled = gpt_pipeline.sharded_loss_and_grads(mesh, config, table).lower(placed, batch).compile()
        rows.append(
            {
                "mode": f"PP {n_stages} {name}",
                "mesh": f"{n_stages} stages, M={n_micro}",
                "got": collectives(compiled.as_text(), mesh.shape),
                "theory": pipeline_theory(config, shared, batch_size, n_micro, n_stages),
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "buffer_bytes": 2 * pipeline_schedules.buffer_slots(table) * activation * 4,
            }
        )
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
