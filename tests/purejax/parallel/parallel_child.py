"""Child process for the purejax.parallel tests: 8 simulated CPU devices (XLA_FLAGS must be set before jax is
imported; the test process has one device). Runs every check that needs a mesh once, compares it with the
single-device computation, and writes the numbers to a JSON file that the tests assert on.

    python parallel_child.py OUT.json
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
from purejax import tree as tree_lib  # noqa: E402
from purejax.nn import attention  # noqa: E402
from purejax.parallel import DATA, MODEL, MeshAxes  # noqa: E402
from purejax.parallel.step import with_shard_key  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

CONFIG = gpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=8, n_embd=32)
BATCH = 8
# (dp, tp, fsdp): data only, both axes, tensor only, and FSDP alone and with tensor parallelism (2 x 4 runs below)
MODES = [(8, 1, False), (8, 1, True), (4, 2, False), (4, 2, True), (1, 8, False)]


def mode_name(dp: int, tp: int, fsdp: bool) -> str:
    return f"{dp}x{tp}" + ("-fsdp" if fsdp else "")


def make_params(config: gpt.GPTConfig, seed: int = 0) -> gpt.Params:
    """Random params from numpy (no jitted jax.random calls): every weight, bias and LayerNorm non-trivial."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)


def make_batch(seed: int = 1, batch: int = BATCH) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, CONFIG.vocab_size, (batch, CONFIG.block_size))
    targets = rng.integers(0, CONFIG.vocab_size, (batch, CONFIG.block_size))
    targets[0, :10] = -1  # ignored positions, unevenly spread over the data shards
    targets[5, 3:] = -1
    return jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def setup(dp: int, tp: int, fsdp: bool):
    mesh = parallel.make_mesh(dp, tp)
    axes = MeshAxes.of(mesh, fsdp=fsdp)
    return mesh, axes, gpt_parallel.param_specs(CONFIG, axes, mesh.shape)


def collectives(compiled, mesh) -> dict[str, dict[str, int]]:
    """`executed_collectives` of a compiled program, keyed "<kind>@<axes>" (JSON-friendly)."""
    counts = executed_collectives(compiled.as_text(), dict(mesh.shape))
    return {f"{kind}@{'+'.join(axes)}": n for (kind, axes), n in counts.items()}


def equivalence(params, batch, reference) -> dict:
    """Loss and gradients of the model on every mesh of MODES (`jax.grad` under a plain shard_map) against the
    single-device ones, and whether each gradient comes back split like its param."""
    out = {}
    for dp, tp, fsdp in MODES:
        mesh, axes, specs = setup(dp, tp, fsdp)
        grad_fn = jax.value_and_grad(functools.partial(gpt_parallel.loss, config=CONFIG, axes=axes))
        sharded = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(specs, P(axes.data)), out_specs=(P(), specs)))
        loss, grads = sharded(parallel.shard(params, specs, mesh), batch)
        ref_loss, ref_grads = reference
        flat, ref_flat = tree_lib.flatten(grads), tree_lib.flatten(ref_grads)
        want = {p: jax.sharding.NamedSharding(mesh, s) for p, s in zip(flat, jax.tree.leaves(specs))}
        out[mode_name(dp, tp, fsdp)] = {
            "loss_rel_err": rel_err(loss, ref_loss),
            "grad_rel_err": {path: rel_err(flat[path], ref_flat[path]) for path in ref_flat},
            "grads_misplaced": [p for p, g in flat.items() if not g.sharding.is_equivalent_to(want[p], g.ndim)],
        }
    return out


def training(params, batch) -> dict:
    """Three AdamW steps with clipping (active: max norm below the gradient norm) on two meshes against one
    device: the params, the optimizer state and the logged grad_norm."""
    optimizer = optim.adamw(1e-2, weight_decay=0.1)

    def loss_fn(axes):
        def loss(p, b, key):
            aux = {}
            if axes is not None:  # whether the step gave the data shards keys of their own
                bits = jax.random.key_data(key).astype(jnp.float32)
                aux["keys_differ"] = jnp.any(jax.lax.pmax(bits, DATA) != jax.lax.pmin(bits, DATA)).astype(jnp.float32)
            return gpt_parallel.loss(p, b, CONFIG, key=key, axes=axes), aux

        return loss

    kwargs = dict(optimizer=optimizer, max_grad_norm=0.5)
    single = jax.jit(functools.partial(optim.train_step, loss_fn=loss_fn(None), **kwargs))
    state = optim.init_train_state(params, optimizer, jax.random.key(0))
    ref_norms = []
    for _ in range(3):
        state, metrics = single(state, batch)
        ref_norms.append(float(metrics["grad_norm"]))
    out = {"ref_grad_norms": ref_norms, "n_params": tree_lib.count(params)}
    for dp, tp, fsdp in [(4, 2, True), (8, 1, False)]:
        mesh, axes, specs = setup(dp, tp, fsdp)
        sstate = optim.init_train_state(params, optimizer, jax.random.key(0))
        sspecs = parallel.state_specs(sstate, specs)
        sstate = parallel.shard(sstate, sspecs, mesh)
        step = parallel.sharded_train_step(mesh, sspecs, P(axes.data), loss_fn=loss_fn(axes), **kwargs)
        norms = []
        for _ in range(3):
            sstate, metrics = step(sstate, batch)
            norms.append(float(metrics["grad_norm"]))
        got, want = tree_lib.flatten(sstate.params), tree_lib.flatten(state.params)
        # The key biases get gradients of pure rounding noise (softmax ignores a constant added to every
        # logit of a row, and q . b_k is one), which Adam scales up to +-lr: compare every other column.
        k_bias = np.arange(3 * CONFIG.n_embd).reshape(CONFIG.n_head, 3, -1)[:, 1].ravel()
        for tree in (got, want):
            tree["blocks.attn.qkv.b"] = np.delete(np.asarray(tree["blocks.attn.qkv.b"]), k_bias, axis=-1)
        mu = tree_lib.flatten(sstate.opt_state)
        out[mode_name(dp, tp, fsdp)] = {
            "params_rel_err": max(rel_err(got[p], want[p]) for p in want),
            "opt_state_rel_err": max(rel_err(v, tree_lib.flatten(state.opt_state)[p]) for p, v in mu.items()),
            "grad_norms": norms,
            "wte_local_shape": list(sstate.params["wte"]["w"].addressable_shards[0].data.shape),
            "mu_wte_local_shape": list(
                next(v for p, v in mu.items() if p.endswith("mu.wte.w")).addressable_shards[0].data.shape
            ),
            "keys_differ_over_data": float(metrics["keys_differ"]),
        }
    return out


def steps(params) -> dict:
    """One SGD step (no clipping) of `sharded_train_step` with the batch whole or in k micro-batches, on every
    kind of mesh, against one device's step on the whole batch in one piece: the params and the loss metric
    (every target counts, so the mean of the micro-batch means is the whole batch's mean); and the
    collectives one device executes in the compiled step, by kind and mesh axes (`executed_collectives`),
    with the sizes the tests' expectations are made of."""
    idx, targets = make_batch(batch=32)
    batch = (idx, jnp.where(targets < 0, 0, targets))
    optimizer = optim.sgd(0.1)

    def loss_fn(axes):
        return lambda p, b, k: (gpt_parallel.loss(p, b, CONFIG, key=k, axes=axes), {})

    single = jax.jit(functools.partial(optim.train_step, loss_fn=loss_fn(None), optimizer=optimizer))
    want, want_metrics = single(optim.init_train_state(params, optimizer, jax.random.key(0)), batch)
    out = {}
    cases = [
        (8, 1, False, 1),
        (8, 1, False, 4),
        (4, 2, False, 1),
        (4, 2, False, 4),
        (8, 1, True, 1),
        (8, 1, True, 4),
        (4, 2, True, 2),
        (1, 8, False, 2),
    ]
    for dp, tp, fsdp, k in cases:
        mesh, axes, specs = setup(dp, tp, fsdp)
        state = optim.init_train_state(params, optimizer, jax.random.key(0))
        sspecs = parallel.state_specs(state, specs)
        step = parallel.sharded_train_step(
            mesh, sspecs, P(axes.data), loss_fn=loss_fn(axes), optimizer=optimizer, micro_batches=k
        )
        name = f"{mode_name(dp, tp, fsdp)}-k{k}"
        state = parallel.shard(state, sspecs, mesh)
        try:
            compiled = step.lower(state, batch).compile()
            got, metrics = compiled(state, batch)
        except Exception as e:  # reported, so that the test names the mesh and the error
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        flat, ref = tree_lib.flatten(got.params), tree_lib.flatten(want.params)
        out[name] = {
            "params_rel_err": max(rel_err(flat[p], ref[p]) for p in ref),
            "loss_rel_err": rel_err(metrics["loss"], want_metrics["loss"]),
            **collectives(compiled, mesh),
            **local_sizes(params, specs, mesh),
        }
    return out


def local_sizes(params, specs, mesh) -> dict[str, int]:
    """Elements one device holds of the params not split over the data axis, and of those split over it
    (FSDP): the top-level ones, and one layer's of the blocks."""
    sizes, split = {}, set()
    for (path, a), spec in zip(tree_lib.flatten(params).items(), jax.tree.leaves(specs)):
        sizes[path] = int(np.prod(parallel.local_shape(a.shape, spec, mesh.shape)))
        if DATA in parallel.spec_axes(spec):
            split.add(path)
    blocks = sum(n for p, n in sizes.items() if p in split and p.startswith("blocks."))
    return {
        "replicated_local": sum(n for p, n in sizes.items() if p not in split),
        "split_local_top": sum(n for p, n in sizes.items() if p in split) - blocks,
        "split_local_layer": blocks // CONFIG.n_layer,
    }


def tp_block_hlo(params) -> dict:
    """The compiled forward and backward of one block on a 1 x 8 mesh: Megatron's 2 + 2 all-reduces."""
    mesh, axes, specs = setup(1, 8, False)
    layer = jax.tree.map(lambda a: a[0], params["blocks"])
    layer_specs = parallel.layer_specs(specs["blocks"])
    x = jnp.ones((2, CONFIG.block_size, CONFIG.n_embd))

    def fwd(p, x):
        return jnp.sum(gpt.block(p, x, CONFIG, axis_name=MODEL))

    counts = {}
    both = jax.value_and_grad(fwd, argnums=(0, 1))  # the value too: else the last psum's output is dead code
    for name, fn, out_specs in [("forward", fwd, P()), ("forward_backward", both, (P(), (layer_specs, P())))]:
        sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(layer_specs, P()), out_specs=out_specs))
        counts[name] = collectives(sharded.lower(layer, x).compile(), mesh)
    return counts


def d_times_trap(params, batch) -> dict:
    """Data parallel on 8 x 1: the pmap-era habit (the gradient of the shard's own mean loss with respect to
    the replicated params, then pmean), on a batch without ignored tokens (every shard weighs the same),
    against one device."""
    mesh, axes, specs = setup(8, 1, False)

    def naive(p, b):
        grads = jax.grad(functools.partial(gpt.loss, config=CONFIG))(p, b)  # the shard's own mean
        return jax.lax.pmean(grads, DATA)

    even = (batch[0], jnp.where(batch[1] < 0, 0, batch[1]))
    single = jax.jit(jax.grad(functools.partial(gpt.loss, config=CONFIG)))(params, even)
    got = jax.jit(jax.shard_map(naive, mesh=mesh, in_specs=(specs, P(DATA)), out_specs=specs))(params, even)
    norm = tree_lib.global_norm
    return {
        "naive_over_single": float(norm(got) / norm(single)),
        "naive_over_8_rel_err": max(rel_err(g / 8, s) for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(single))),
    }


def global_norms() -> dict:
    """A tree with a 2-D sharded, a model-sharded and a replicated leaf on a 4 x 2 mesh."""
    mesh = parallel.make_mesh(4, 2)
    rng = np.random.default_rng(3)
    tree = {"a": rng.standard_normal((8, 4)), "b": rng.standard_normal(6), "c": rng.standard_normal(3)}
    specs = {"a": P(DATA, MODEL), "b": P(MODEL), "c": P()}
    want = float(np.sqrt(sum(np.sum(v**2) for v in tree.values())))
    tree = parallel.shard(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree), specs, mesh)

    def norms(t):
        every_axis = tree_lib.global_norm(t, (DATA, MODEL))  # the naive form: every leaf psum-med everywhere
        return tree_lib.global_norm(t, specs=specs), every_axis

    sharded = jax.shard_map(norms, mesh=mesh, in_specs=(specs,), out_specs=(P(), P()), check_vma=False)
    ours, naive = jax.jit(sharded)(tree)
    return {"numpy": want, "ours": float(ours), "naive": float(naive)}


def dropout_masks(params) -> dict:
    """gpt_parallel.hidden with dropout on a 2 x 4 mesh, every row of the batch the same, its key folded with
    the data index as the training step folds it: the activations (replicated over model) must agree across
    model shards and differ across data shards."""
    config = dataclasses.replace(CONFIG, dropout=0.5)
    mesh = parallel.make_mesh(2, 4)
    axes = MeshAxes.of(mesh)
    specs = gpt_parallel.param_specs(config, axes, mesh.shape)
    idx = jnp.tile(make_batch()[0][:1], (2, 1))

    def hidden(p, idx, key):
        return gpt_parallel.hidden(p, idx, config, key=key, axes=axes)[None, None]

    sharded = jax.shard_map(
        with_shard_key(hidden, (DATA,)), mesh=mesh, in_specs=(specs, P(DATA), P()), out_specs=P(DATA, MODEL)
    )
    h = jax.jit(sharded)(parallel.shard(params, specs, mesh), idx, jax.random.key(0))
    h = np.asarray(h)  # (data, model, 1, seq, d)
    return {
        "max_diff_across_model": float(np.abs(h[:, 1:] - h[:, :1]).max()),
        "max_diff_across_data": float(np.abs(h[1] - h[0]).max()),
    }


def attention_dropout_per_head() -> dict:
    """Heads split over 4 devices, all with the same weights. The output projection reads only device 0's
    head (run A) or only device 1's (run B): equal without dropout; with dropout, equal only if both devices
    drew the same attention-probability mask, which they must not."""
    config = attention.AttentionConfig(d_model=16, n_head=4, dropout=0.5, causal=True)
    mesh = parallel.make_mesh(2, 4)
    rng = np.random.default_rng(4)
    group = rng.standard_normal((16, 12))  # one head's q, k, v columns (grouped layout)
    x = jnp.asarray(rng.standard_normal((1, 8, 16)), jnp.float32)
    rows = rng.standard_normal((4, 16))
    specs = {"qkv": {"w": P(None, MODEL), "b": P(MODEL)}, "proj": {"w": P(MODEL, None), "b": P()}}

    def params_reading(head):
        proj = np.zeros((16, 16))
        proj[4 * head : 4 * head + 4] = rows
        return jax.tree.map(
            lambda a: jnp.asarray(a, jnp.float32),
            {"qkv": {"w": np.tile(group, 4), "b": np.zeros(48)}, "proj": {"w": proj, "b": np.zeros(16)}},
        )

    def run(p, x, key):
        return attention.apply(p, x, config, key=key, axis_name=MODEL)

    def run_eval(p, x):
        return attention.apply(p, x, config, axis_name=MODEL)

    sharded = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P()))
    evaluation = jax.jit(jax.shard_map(run_eval, mesh=mesh, in_specs=(specs, P()), out_specs=P()))
    a, b = evaluation(params_reading(0), x), evaluation(params_reading(1), x)
    out = {"without_dropout": float(np.abs(np.asarray(a) - np.asarray(b)).max())}
    key = jax.random.key(1)
    a, b = sharded(params_reading(0), x, key), sharded(params_reading(1), x, key)
    out["with_dropout"] = float(np.abs(np.asarray(a) - np.asarray(b)).max())
    return out


def errors() -> dict:
    """Errors raised at trace time under a mesh."""
    out = {}
    mesh = parallel.make_mesh(1, 8)
    config = attention.AttentionConfig(d_model=32, n_head=4, causal=True)
    params = attention.init(jax.random.key(0), config)
    specs = {"qkv": {"w": P(None, MODEL), "b": P(MODEL)}, "proj": {"w": P(MODEL, None), "b": P()}}
    try:
        jax.shard_map(
            lambda p, x: attention.apply(p, x, config, axis_name=MODEL), mesh=mesh, in_specs=(specs, P()), out_specs=P()
        )(params, jnp.ones((1, 4, 32)))
    except Exception as e:  # the message is what is tested
        out["attention_heads"] = str(e)
    mesh, axes, specs = setup(4, 2, False)
    try:  # unsharded params passed with replicated specs: the model notices they are not its shards
        replicated = jax.tree.map(lambda s: P(), specs, is_leaf=lambda x: isinstance(x, P))
        jax.shard_map(
            functools.partial(gpt_parallel.loss, config=CONFIG, axes=axes),
            mesh=mesh,
            in_specs=(replicated, P(DATA)),
            out_specs=P(),
        )(make_params(CONFIG), make_batch())
    except Exception as e:  # the message is what is tested
        out["unsharded_params"] = str(e)
    return out


def main(path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    params, batch = make_params(CONFIG), make_batch()
    reference = jax.jit(jax.value_and_grad(functools.partial(gpt.loss, config=CONFIG)))(params, batch)
    checks = {
        "equivalence": lambda: equivalence(params, batch, reference),
        "training": lambda: training(params, batch),
        "steps": lambda: steps(params),
        "tp_block_hlo": lambda: tp_block_hlo(params),
        "d_times_trap": lambda: d_times_trap(params, batch),
        "global_norm": global_norms,
        "dropout": lambda: dropout_masks(params),
        "attention_dropout": attention_dropout_per_head,
        "errors": errors,
    }
    results = {}
    for name, check in checks.items():
        start = time.perf_counter()
        results[name] = check()
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
