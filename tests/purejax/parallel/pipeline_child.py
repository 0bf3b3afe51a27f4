"""Child process for tests/purejax/parallel/test_pipeline.py: 8 simulated CPU devices (XLA_FLAGS must be set
before jax is imported). Runs the runner with a stage that is not a GPT (a stack of linear layers and a squared
error) against one device's loss and gradients of the same function; runs the pipelined GPT loss and gradients
(models/gpt_pipeline.py) for a few (stages, micro-batches, schedule, dropout) cases, compares them with one
device's, counts the compiled program's collectives; runs `gpt_pipeline.loss` inside `sharded_train_step` on
pp, dp x pp and dp x pp x tp meshes for a few AdamW steps against `optim.train_step` on one device; and writes
the numbers to a JSON file that the tests assert on.

    python pipeline_child.py OUT.json
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses
import functools
import json

from jaxtyping import install_import_hook

# run-time shape checks, as in the test process (tests/conftest.py)
install_import_hook(["purejax"], "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import gpt, gpt_parallel, gpt_pipeline  # noqa: E402
from purejax import losses, optim, parallel  # noqa: E402
from purejax import tree as tree_lib  # noqa: E402
from purejax.nn import stack  # noqa: E402
from purejax.parallel import pipeline, pipeline_schedules  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

CONFIG = gpt.GPTConfig(block_size=8, vocab_size=32, n_layer=4, n_head=2, n_embd=16)
BATCH = 4
# (stages, micro-batches, schedule, dropout rate)
# (1F1B with M > S reuses its buffer slots; the two dropout cases share one reference)
CASES = [(4, 4, "gpipe", 0.1), (2, 4, "1f1b", 0.1)]
# inside the training step: (pp, dp, tp, schedule, micro-batches, dropout rate, gradient accumulation steps)
STEP_CASES = [
    (4, 1, 1, "1f1b", 4, 0.0, 2),
    (2, 2, 1, "1f1b", 2, 0.1, 2),
    (2, 2, 2, "gpipe", 2, 0.0, 1),
]


def make_params(seed: int = 0) -> gpt.Params:
    """Random params from numpy: every weight, bias and LayerNorm non-trivial."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=CONFIG), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)


def make_batch(seed: int = 1, rows: int = BATCH):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
    targets = rng.integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
    targets[0, :5] = -1  # ignored positions, unevenly spread over the micro-batches
    return jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32)


@functools.cache
def reference_fn(config, n_micro):
    """`(params, batch, key) -> (loss, grads)` of `reference`, compiled once per (config, M)."""
    if config.dropout == 0:
        return jax.jit(jax.value_and_grad(lambda p, b, _: gpt.loss(p, b, config)))
    return jax.jit(jax.value_and_grad(functools.partial(_reference_loss, config=config, n_micro=n_micro)))


def reference(params, batch, config, n_micro, key):
    """One device: the sum over micro-batches m (consecutive rows, key `split(key, M)[m]`) of the summed token
    losses over the whole batch's token count; without dropout, plain `gpt.loss` on the whole batch."""
    return reference_fn(config, n_micro)(params, batch, key)


def _reference_loss(params, batch, key, *, config, n_micro):
    return _micro_batch_sum(params, batch, key, config, n_micro) / jnp.sum(batch[1] != -1)


def _micro_batch_sum(params, batch, key, config, n_micro):
    """The summed token losses of `batch` cut into `n_micro` micro-batches, micro-batch m with `split(key, M)[m]`."""
    idx, targets = batch
    keys, rows = jax.random.split(key, n_micro), idx.shape[0] // n_micro
    total = 0.0
    for m in range(n_micro):
        part = slice(m * rows, (m + 1) * rows)
        per_token = losses.cross_entropy(gpt.apply(params, idx[part], config, key=keys[m]), targets[part])
        total += jnp.sum(jnp.where(targets[part] != -1, per_token, 0.0))
    return total


def _step_reference_loss(params, batch, key, *, config, dp, n_micro):
    """One device's version of what `sharded_train_step` makes of `gpt_pipeline.loss`: data shard d takes the d-th
    block of rows with `fold_in(key, d)` (none without a data axis), pipelined in `n_micro` micro-batches."""
    rows, total = batch[0].shape[0] // dp, 0.0
    for d in range(dp):
        part = tuple(a[d * rows : (d + 1) * rows] for a in batch)
        total += _micro_batch_sum(params, part, key if dp == 1 else jax.random.fold_in(key, d), config, n_micro)
    return total / jnp.sum(batch[1] != -1)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_case(params, batch, n_stages, n_micro, name, rate) -> dict:
    config = dataclasses.replace(CONFIG, dropout=rate)
    mesh = jax.make_mesh((n_stages,), (pipeline.PIPE,), devices=jax.devices()[:n_stages])
    table = pipeline_schedules.SCHEDULES[name](n_stages, n_micro)
    specs = pipeline.param_specs(params)
    fn = gpt_pipeline.sharded_loss_and_grads(mesh, config, table)
    key = jax.random.key(7)
    placed = parallel.shard(params, specs, mesh)
    compiled = fn.lower(placed, batch, key).compile()
    loss, grads = compiled(placed, batch, key)
    ref_loss, ref_grads = reference(params, batch, config, n_micro, key)
    flat, ref_flat = tree_lib.flatten(grads), tree_lib.flatten(ref_grads)
    counts = executed_collectives(compiled.as_text(), {pipeline.PIPE: n_stages})
    return {
        "steps": len(table),
        "loss": float(loss),
        "loss_rel_err": rel_err(loss, ref_loss),
        "grad_rel_err": {path: rel_err(flat[path], ref_flat[path]) for path in ref_flat},
        "collectives": {kind: n for (kind, _), n in counts.items()},
        "loss_without_dropout": float(gpt.loss(params, batch, CONFIG)),
        "non_block_params": tree_lib.count({k: v for k, v in params.items() if k != "blocks"}),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "adamw_params_rel_err": adamw_steps(params, placed, batch, config, n_micro, fn) if name == "1f1b" else None,
    }


def adamw_steps(params, placed, batch, config, n_micro, pipelined, steps: int = 3) -> float:
    """Three AdamW steps from the pipelined gradients against three from one device's, a fresh dropout key
    each step: the relative error of the final params, all leaves as one vector, but for the key projection's
    bias: its true gradient is 0 (softmax ignores a constant added to every score of a query), so Adam's
    m / sqrt(v) scales either run's rounding noise up to the learning rate, in a different direction."""
    optimizer = optim.adamw(1e-2, weight_decay=0.1)
    update = jax.jit(lambda p, g, s: (lambda u, s: (optim.apply_updates(p, u), s))(*optimizer.update(g, s, p)))
    ours, ours_state, ref, ref_state = placed, optimizer.init(placed), params, optimizer.init(params)
    for step in range(steps):
        key = jax.random.key(100 + step)
        ours, ours_state = update(ours, pipelined(ours, batch, key)[1], ours_state)
        ref, ref_state = update(ref, reference(ref, batch, config, n_micro, key)[1], ref_state)
    return rel_err(*(flat_without_key_bias(tree) for tree in (ours, ref)))


def flat_without_key_bias(params) -> np.ndarray:
    """Every param in one vector, the key bias left out: qkv's bias is [q_h k_h v_h] per head (attention.py)."""
    flat = {path: np.asarray(leaf) for path, leaf in tree_lib.flatten(params).items()}
    bias = flat.pop("blocks.attn.qkv.b").reshape(CONFIG.n_layer, CONFIG.n_head, 3, -1)
    return np.concatenate([*(leaf.ravel() for leaf in flat.values()), bias[:, :, [0, 2]].ravel()])


def gpipe_temp_bytes(params, batch, n_stages, n_micro, rate) -> int:
    """XLA's temporaries of the GPipe program (compiled, not run), to set beside a 1F1B case's."""
    mesh = jax.make_mesh((n_stages,), (pipeline.PIPE,), devices=jax.devices()[:n_stages])
    fn = gpt_pipeline.sharded_loss_and_grads(
        mesh, dataclasses.replace(CONFIG, dropout=rate), pipeline_schedules.gpipe(n_stages, n_micro)
    )
    placed = parallel.shard(params, pipeline.param_specs(params), mesh)
    return fn.lower(placed, batch, jax.random.key(7)).compile().memory_analysis().temp_size_in_bytes


def one_device_order(batch, dp: int, accumulate: int):
    """The rows reordered so that one device's gradient accumulation sees, in micro-batch g, the rows every
    data shard d has in its micro-batch g (the sharded step splits the rows over the shards first), shard by
    shard, as `_step_reference_loss` expects them."""
    rows = batch[0].shape[0] // (dp * accumulate)
    return tuple(a.reshape(dp, accumulate, rows, -1).transpose(1, 0, 2, 3).reshape(a.shape) for a in batch)


def train_case(pp, dp, tp, name, n_micro, rate, accumulate, steps: int = 3) -> dict:
    """`steps` AdamW steps of `sharded_train_step` with `gpt_pipeline.loss` (clipping on, gradient accumulation
    `accumulate`, a batch of 8 rows with ignored targets) against `optim.train_step` on one device with
    `_step_reference_loss`; and the pipelined forward alone (evaluation) against `gpt.loss`."""
    config = dataclasses.replace(CONFIG, dropout=rate)
    mesh = parallel.make_mesh(dp, tp, jax.devices()[: pp * dp * tp], pp=pp)
    axes = parallel.MeshAxes.of(mesh)
    specs = pipeline.stage_specs(gpt_parallel.param_specs(config, axes, mesh.shape))
    table = pipeline_schedules.SCHEDULES[name](pp, n_micro)
    optimizer = optim.adamw(1e-2, weight_decay=0.1)
    state = optim.init_train_state(make_params(), optimizer, jax.random.key(3))
    state_specs = parallel.state_specs(state, specs)

    def loss_fn(params, batch, key):
        return gpt_pipeline.loss(params, batch, config, table, key=key, axes=axes), {}

    kwargs = dict(optimizer=optimizer, max_grad_norm=1.0, micro_batches=accumulate)
    step = parallel.sharded_train_step(mesh, state_specs, P(axes.data), loss_fn=loss_fn, **kwargs)
    reference_loss = functools.partial(_step_reference_loss, config=config, dp=dp, n_micro=n_micro)
    ref_step = jax.jit(
        functools.partial(optim.train_step, loss_fn=lambda p, b, k: (reference_loss(p, b, k), {}), **kwargs)
    )
    ours, ref, loss_errs = parallel.shard(state, state_specs, mesh), state, []
    for i in range(steps):
        batch = make_batch(10 + i, rows=8)
        ours, metrics = step(ours, batch)
        ref, ref_metrics = ref_step(ref, one_device_order(batch, dp, accumulate))
        loss_errs.append(rel_err(metrics["loss"], ref_metrics["loss"]))
    evaluate = jax.jit(
        jax.shard_map(
            lambda p, x, y: gpt_pipeline.loss(p, (x, y), CONFIG, table, axes=axes),
            mesh=mesh,
            in_specs=(specs, P(axes.data), P(axes.data)),
            out_specs=P(),
            check_vma=True,
        )
    )
    params, batch = make_params(), make_batch(rows=8)
    return {
        "loss_rel_err": max(loss_errs),
        "params_rel_err": rel_err(*(flat_without_key_bias(s.params) for s in (ours, ref))),
        "moved": rel_err(flat_without_key_bias(ref.params), flat_without_key_bias(state.params)),
        "eval_rel_err": rel_err(evaluate(parallel.shard(params, specs, mesh), *batch), gpt.loss(params, batch, CONFIG)),
    }


WIDTH = 8  # the linear stack's activations


def linear_stage(params, x, micro, n_tokens, *, key, axes):
    """A stage that is not a GPT: stage 0 lifts each input number to a vector, every stage runs its tanh linear
    layers, the last one reads a number back out and returns its squared errors over n_tokens (targets of -1
    ignored). `key` is unused: nothing is random."""
    s, n_stages = jax.lax.axis_index(axes.pipe), jax.lax.axis_size(axes.pipe)
    inputs, targets = micro
    x = jax.lax.cond(s == 0, lambda: inputs[..., None] * params["lift"], lambda: x)
    x = stack.scan(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]), params["blocks"], x)

    def squared_error():
        error = jnp.where(targets != -1, x @ params["readout"] - targets, 0.0)
        return jnp.sum(error**2) / n_tokens

    return x, jax.lax.cond(s == n_stages - 1, squared_error, lambda: jnp.zeros_like(x[0, 0, 0]))


def linear_loss(params, batch):
    """One device, the whole batch at once: the function the stages compute, written out."""
    inputs, targets = batch
    x = inputs[..., None] * params["lift"]
    for w, b in zip(params["blocks"]["w"], params["blocks"]["b"]):
        x = jnp.tanh(x @ w + b)
    error = jnp.where(targets != -1, x @ params["readout"] - targets, 0.0)
    return jnp.sum(error**2) / jnp.sum(targets != -1)


def linear_case(n_stages: int = 4, n_micro: int = 2, depth: int = 8) -> dict:
    """The runner with `linear_stage` (1F1B) against `jax.value_and_grad(linear_loss)` on one device; and the
    error a stack whose depth the stage count does not divide raises when called."""
    rng = np.random.default_rng(5)

    def normal(*shape):
        return jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)

    params = {
        "lift": normal(WIDTH),
        "blocks": {"w": normal(depth, WIDTH, WIDTH), "b": normal(depth, WIDTH)},
        "readout": normal(WIDTH),
    }
    inputs, targets = normal(BATCH, 6), np.array(normal(BATCH, 6))
    targets[1, :4] = -1  # ignored positions
    batch = (inputs, jnp.asarray(targets))
    mesh = jax.make_mesh((n_stages,), (pipeline.PIPE,), devices=jax.devices()[:n_stages])
    fn = pipeline.sharded_loss_and_grads(
        mesh, linear_stage, pipeline_schedules.one_f_one_b(n_stages, n_micro), width=WIDTH
    )
    loss, grads = fn(parallel.shard(params, pipeline.param_specs(params), mesh), batch)
    ref_loss, ref_grads = jax.value_and_grad(linear_loss)(params, batch)
    flat, ref_flat = tree_lib.flatten(grads), tree_lib.flatten(ref_grads)
    odd = {**params, "blocks": jax.tree.map(lambda a: a[:-1], params["blocks"])}
    try:  # refused while tracing, before the params are placed
        fn(odd, batch)
        depth_error = ""
    except ValueError as error:
        depth_error = str(error)
    return {
        "loss_rel_err": rel_err(loss, ref_loss),
        "grad_rel_err": {path: rel_err(flat[path], ref_flat[path]) for path in ref_flat},
        "depth_error": depth_error,
    }


def main(out: str) -> None:
    params, batch = make_params(), make_batch()
    results = {"linear": linear_case()}
    results.update(
        {f"S{s}-M{m}-{name}-p{rate}": run_case(params, batch, s, m, name, rate) for s, m, name, rate in CASES}
    )
    results["gpipe_temp_bytes"] = {"S2-M4-p0.1": gpipe_temp_bytes(params, batch, 2, 4, 0.1)}
    for pp, dp, tp, name, n_micro, rate, accumulate in STEP_CASES:
        case = f"pp{pp}-dp{dp}-tp{tp}-{name}-M{n_micro}-p{rate}-ga{accumulate}"
        results[case] = train_case(pp, dp, tp, name, n_micro, rate, accumulate)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
