"""Child process for test_gpt_sequence_parallel.py: the GPT under Megatron sequence parallelism on 8 simulated
CPU devices (XLA_FLAGS must be set before jax is imported; the test process has one device). Writes what it
measured to a JSON file.

    python sequence_child.py OUT.json
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses
import functools
import json
import time

from jaxtyping import install_import_hook

# run-time shape checks, as in the test process (tests/conftest.py)
install_import_hook(["purejax"], "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import gpt, gpt_parallel  # noqa: E402
from purejax import optim, parallel  # noqa: E402
from purejax.parallel import MeshAxes  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

GPT = gpt.GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16)
DROPOUT = dataclasses.replace(GPT, dropout=0.1)
NO_BIAS = dataclasses.replace(GPT, bias=False)  # for Adam: the key bias's gradient is zero but for rounding
BATCH = 4
SGD = optim.sgd(1.0)  # one step: new params = params - gradients, so both are checked in one program
ADAMW = optim.adamw(1e-2, weight_decay=0.1)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def data(config: gpt.GPTConfig, seq: int, seed: int = 0):
    """Params drawn at std 0.3 (larger than init's, so every block matters) and a batch with ignored targets."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)
    idx = rng.integers(0, config.vocab_size, (BATCH, seq))
    targets = rng.integers(0, config.vocab_size, (BATCH, seq))
    targets[0, :10], targets[3, 5:] = -1, -1  # ignored targets, unevenly spread over the devices
    return params, (jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32))


def loss_fn(config: gpt.GPTConfig, axes: MeshAxes | None):
    return lambda params, batch, key: (gpt_parallel.loss(params, batch, config, key=key, axes=axes), {})


def mesh_axes(dp: int, tp: int, *, sp: bool, fsdp: bool = False) -> tuple[jax.sharding.Mesh, MeshAxes]:
    mesh = parallel.make_mesh(dp, tp, jax.devices()[: dp * tp])
    return mesh, MeshAxes.of(mesh, fsdp=fsdp, sp=sp)


def sharded_steps(config, dp, tp, *, sp, fsdp=False, optimizer=SGD, steps=1, micro_batches=1, seed=0):
    """`steps` sharded training steps from `data(config)` and key(seed): (final state, the losses)."""
    params, batch = data(config, config.block_size)
    mesh, axes = mesh_axes(dp, tp, sp=sp, fsdp=fsdp)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    state = optim.init_train_state(params, optimizer, jax.random.key(seed))
    state_specs = parallel.state_specs(state, specs)
    step = parallel.sharded_train_step(
        mesh, state_specs, P(axes.data), loss_fn=loss_fn(config, axes), optimizer=optimizer, micro_batches=micro_batches
    )
    state, losses = parallel.shard(state, state_specs, mesh), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state), losses


def single_steps(config, *, optimizer=SGD, steps=1, micro_batches=1, seed=0, dp=1):
    """The same steps on one device: `optim.train_step` over gpt.loss (through gpt_parallel with no axes). The
    rows are put in the order that gives each micro-batch the rows it has on a mesh with `dp` data shards
    (micro-batch i: the i-th of every shard's), since the step averages the micro-batches' own means."""
    params, batch = data(config, config.block_size)
    order = np.arange(BATCH).reshape(dp, micro_batches, -1).transpose(1, 0, 2).ravel()
    batch = tuple(x[order] for x in batch)
    step = jax.jit(
        functools.partial(
            optim.train_step, loss_fn=loss_fn(config, None), optimizer=optimizer, micro_batches=micro_batches
        )
    )
    state, losses = optim.init_train_state(params, optimizer, jax.random.key(seed)), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def compare(got, want) -> dict:
    """Relative errors of the losses, the params and (for SGD(1) from the same params) the gradients."""
    (got_state, got_losses), (want_state, want_losses) = got, want
    return {
        "loss_rel_err": rel_err(got_losses, want_losses),
        "params_rel_err": rel_err(flat(got_state.params), flat(want_state.params)),
        "opt_state_rel_err": rel_err(flat(got_state.opt_state), flat(want_state.opt_state))
        if jax.tree.leaves(want_state.opt_state)
        else 0.0,
        "loss": got_losses[-1],
    }


SGD_MESHES = [(2, 4, False), (2, 4, True)]  # (dp, tp, fsdp), all with sp: both axes at once, and FSDP too


def equivalence() -> dict:
    """One SGD(1) step (params - gradients) under sp on each mesh against one device, without dropout; with
    dropout, against the same mesh without sp (tensor parallelism draws the same masks, one device cannot:
    each data shard and each device's heads draw their own). Then 3 AdamW steps of 2 accumulated
    micro-batches on 2 x 4 (no biases): against one device without dropout, against tensor parallelism with it."""
    out = {}
    single = single_steps(GPT)
    for dp, tp, fsdp in SGD_MESHES:
        grads_single = flat(data(GPT, 16)[0]) - flat(single[0].params)
        state, losses = sharded_steps(GPT, dp, tp, sp=True, fsdp=fsdp)
        result = compare((state, losses), single)
        result["grad_rel_err"] = rel_err(flat(data(GPT, 16)[0]) - flat(state.params), grads_single)
        out[f"sgd-{dp}x{tp}" + ("-fsdp" if fsdp else "")] = result
    out["sgd-dropout-2x4"] = compare(sharded_steps(DROPOUT, 2, 4, sp=True), sharded_steps(DROPOUT, 2, 4, sp=False))
    out["sgd-dropout-2x4"]["loss_without_dropout"] = out["sgd-2x4"]["loss"]
    kw = {"optimizer": ADAMW, "steps": 3, "micro_batches": 2}
    out["adamw-2x4"] = compare(sharded_steps(NO_BIAS, 2, 4, sp=True, **kw), single_steps(NO_BIAS, dp=2, **kw))
    dropout = dataclasses.replace(NO_BIAS, dropout=0.1)
    out["adamw-dropout-2x4"] = compare(
        sharded_steps(dropout, 2, 4, sp=True, **kw), sharded_steps(dropout, 2, 4, sp=False, **kw)
    )
    return out


def loss_and_grads(config: gpt.GPTConfig, tp: int, sp: bool, *, forward_only: bool = False):
    """The jitted shard_map of gpt_parallel.loss (and its gradients) on a 1 x tp mesh, and its arguments."""
    params, batch = data(config, config.block_size)
    mesh, axes = mesh_axes(1, tp, sp=sp)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    loss = functools.partial(gpt_parallel.loss, config=config, axes=axes)
    if forward_only:
        fn, out_specs = (lambda p, b: loss(p, b)), P()
    else:
        fn, out_specs = (lambda p, b: jax.value_and_grad(loss)(p, b)), (P(), specs)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs, check_vma=True)
    return jax.jit(mapped), (parallel.shard(params, specs, mesh), batch)


def collectives(tp: int = 4) -> dict:
    """The collectives one device executes over the model axis, forward alone and forward + backward, tensor
    parallelism with and without sp, and the sizes they move."""
    out = {"tp": tp, "n_layer": GPT.n_layer, "activation_elements": BATCH * GPT.block_size * GPT.n_embd}
    for sp in (False, True):
        for forward_only in (True, False):
            fn, args = loss_and_grads(GPT, tp, sp, forward_only=forward_only)
            counts = executed_collectives(fn.lower(*args).compile().as_text(), {"data": 1, "model": tp})
            name = f"{'sp' if sp else 'tp'}-{'forward' if forward_only else 'backward'}"
            out[name] = {f"{kind}@{'+'.join(axes)}": c for (kind, axes), c in counts.items()}
    return out


LONG = gpt.GPTConfig(block_size=256, vocab_size=32, n_layer=4, n_head=4, n_embd=128)


def memory(tp: int = 4) -> dict:
    """XLA's compiled memory analysis of one device's loss + gradients for a long sequence, tp = 4 with and
    without sp, with every activation kept and with each block recomputed (remat="block")."""
    out = {}
    for remat in ("none", "block"):
        config = dataclasses.replace(LONG, remat=remat)
        for sp in (False, True):
            fn, args = loss_and_grads(config, tp, sp)
            analysis = fn.lower(*args).compile().memory_analysis()
            out[f"{remat}-{'sp' if sp else 'tp'}"] = {"temp_bytes": analysis.temp_size_in_bytes}
    return out


def errors() -> dict:
    """The messages for what sequence parallelism cannot do, raised while tracing (nothing compiles)."""
    out = {}
    fn, (params, (idx, targets)) = loss_and_grads(GPT, 4, True)
    try:
        jax.eval_shape(fn, params, (idx[:, :6], targets[:, :6]))  # 6 tokens over 4 devices
    except ValueError as e:
        out["uneven"] = str(e)
    try:
        MeshAxes.of(parallel.make_mesh(2, 1, jax.devices()[:2]), sp=True)
    except ValueError as e:
        out["no_tp"] = str(e)
    return out


if __name__ == "__main__":
    results = {}
    parts = [equivalence, collectives, memory, errors]
    for part in parts if len(sys.argv) < 3 else [globals()[name] for name in sys.argv[2:]]:
        start = time.perf_counter()
        results[part.__name__] = part()
        print(f"{part.__name__}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
