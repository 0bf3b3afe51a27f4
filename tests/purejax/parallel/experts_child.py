"""Child process for tests/purejax/parallel/test_experts.py: 8 simulated CPU devices (XLA_FLAGS must be set
before jax is imported). Runs the mixture-of-experts layer with its experts split over the data axis (expert
parallelism) and a GPT with experts under sharded_train_step, compares them with one device, counts the
all_to_alls of the compiled programs, and writes the numbers to a JSON file that the tests assert on.

    python experts_child.py OUT.json
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

from models import gpt, gpt_moe, gpt_parallel  # noqa: E402
from purejax import optim, parallel  # noqa: E402
from purejax import tree as tree_lib  # noqa: E402
from purejax.nn import moe  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

D, FF, E, N = 8, 12, 8, 8  # width, hidden, experts, devices
CONFIG = gpt_moe.MoEConfig(
    block_size=8,
    vocab_size=32,
    n_layer=2,
    n_head=2,
    n_embd=16,
    n_experts=8,
    expert_top_k=2,
    capacity_factor=0.0,
    moe_aux_weight=0.1,
)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def all_to_alls(compiled, mesh) -> dict[str, int]:
    counts = executed_collectives(compiled.as_text(), dict(mesh.shape))
    return {f"{kind} {'x'.join(axes)}": c["ops"] for (kind, axes), c in counts.items()}


def layer_params(seed: int = 0) -> moe.Params:
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: moe.init(k, D, FF, E), jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), jnp.float32), shapes)
    return {**params, "router": {"w": params["router"]["w"] * 3}}


def layer(top_k: int, capacity_factor: float | None) -> dict:
    """The layer on 8 devices (tokens and experts split over "data") against the single-device layer applied
    to each device's tokens: outputs, stats, and the gradient of sum(y * w) + aux; the all_to_alls of the
    forward and of the gradient."""
    mesh = parallel.make_mesh(N, 1)
    params, rng = layer_params(), np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((N * 6, D)), jnp.float32)  # 6 tokens a device
    w = jnp.asarray(rng.standard_normal((N * 6, D)), jnp.float32)
    kwargs = dict(top_k=top_k, capacity_factor=capacity_factor, activation=jnp.tanh)
    specs = {"router": P(), "experts": P("data")}  # the experts' leading axis over "data"

    def local(p, x):
        return moe.apply(p, x, **kwargs, token_axes=("data",), expert_axis="data")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P("data"), P()), check_vma=True)

    def objective(p, x):
        y, stats = sharded(p, x)
        return jnp.sum(y * w) + stats["aux"]

    groups = [moe.apply(params, x[i * 6 : (i + 1) * 6], **kwargs) for i in range(N)]
    want_y = jnp.concatenate([g[0] for g in groups])
    want_dropped = np.mean([float(g[1]["dropped"]) for g in groups])  # every group has as many assignments
    want_aux = moe.apply(params, x, **kwargs)[1]["aux"]  # f and P do not depend on capacity: the whole batch's

    def reference(p, x):
        per_group = [moe.apply(p, x[i * 6 : (i + 1) * 6], **kwargs)[0] for i in range(N)]
        return jnp.sum(jnp.concatenate(per_group) * w) + moe.apply(p, x, **kwargs)[1]["aux"]

    placed, grad = parallel.shard(params, specs, mesh), jax.jit(jax.grad(objective, argnums=(0, 1)))
    y, stats = jax.jit(sharded)(placed, x)
    flat, ref = (
        tree_lib.flatten(grad(placed, x)),
        tree_lib.flatten(jax.jit(jax.grad(reference, argnums=(0, 1)))(params, x)),
    )
    return {
        "y_rel_err": rel_err(y, want_y),
        "aux_rel_err": rel_err(stats["aux"], want_aux),
        "dropped": float(stats["dropped"]),
        "want_dropped": float(want_dropped),
        "grads_rel_err": max(rel_err(flat[k], ref[k]) for k in ref),
        "forward": all_to_alls(jax.jit(sharded).lower(placed, x).compile(), mesh),
        "backward": all_to_alls(grad.lower(placed, x).compile(), mesh),
    }


def gpt_params(config, seed: int = 0) -> gpt.Params:
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)


def gpt_training(dp: int, tp: int, ep: bool, fsdp: bool = False, config=CONFIG) -> dict:
    """Three AdamW steps of sharded_train_step on a dp x tp mesh, with the experts split over the data axis
    (ep), against one device: params, loss and the MoE metrics; the all_to_alls of the compiled step."""
    params, rng = gpt_params(config), np.random.default_rng(2)
    batch = tuple(jnp.asarray(rng.integers(0, config.vocab_size, (16, config.block_size)), jnp.int32) for _ in "ab")
    optimizer = optim.adamw(1e-2, weight_decay=0.1)

    def loss_fn(axes):
        return lambda p, b, k: gpt_parallel.loss_and_metrics(p, b, config, key=k, axes=axes)

    state = optim.init_train_state(params, optimizer, jax.random.key(0))
    single = jax.jit(functools.partial(optim.train_step, loss_fn=loss_fn(None), optimizer=optimizer))
    mesh = parallel.make_mesh(dp, tp)
    axes = parallel.MeshAxes.of(mesh, ep=ep, fsdp=fsdp)
    sspecs = parallel.state_specs(state, gpt_parallel.param_specs(config, axes, mesh.shape))
    step = parallel.sharded_train_step(mesh, sspecs, P(axes.data), loss_fn=loss_fn(axes), optimizer=optimizer)
    sharded = parallel.shard(state, sspecs, mesh)
    compiled = step.lower(sharded, batch).compile()
    out = {"loss_rel_err": 0.0, "aux_rel_err": 0.0, "dropped": 0.0}
    for _ in range(3):
        state, want = single(state, batch)
        sharded, got = compiled(sharded, batch)
        out["loss_rel_err"] = max(out["loss_rel_err"], rel_err(got["loss"], want["loss"]))
        out["aux_rel_err"] = max(out["aux_rel_err"], rel_err(got["moe_aux"], want["moe_aux"]))
        out["dropped"] = max(out["dropped"], float(got["moe_dropped"]))
    flat, ref = tree_lib.flatten(sharded.params), tree_lib.flatten(state.params)
    # The key biases get gradients of pure rounding noise (softmax ignores a constant added to every logit of
    # a row), which Adam scales up to +-lr: their columns are left out, as in parallel_child.py.
    k_bias = np.arange(3 * config.n_embd).reshape(config.n_head, 3, -1)[:, 1].ravel()
    for tree in (flat, ref):
        tree["blocks.attn.qkv.b"] = np.delete(np.asarray(tree["blocks.attn.qkv.b"]), k_bias, axis=-1)
    out["params_rel_err"] = max(rel_err(flat[k], ref[k]) for k in ref)
    out["expert_spec"] = str(sspecs.params["blocks"]["moe"]["experts"]["fc"]["w"])
    out["attn_spec"] = str(sspecs.params["blocks"]["attn"]["qkv"]["w"])
    out["collectives"] = all_to_alls(compiled, mesh)
    return out


def errors() -> dict:
    """The messages of the refused MoE set-ups, raised before anything compiles."""
    out = {}
    cases = {
        "experts_not_divisible": (dataclasses.replace(CONFIG, n_experts=6), dict(ep=True)),
        "ep_without_experts": (gpt_moe.gpt_config({**dataclasses.asdict(CONFIG), "n_experts": 0}), dict(ep=True)),
        "experts_with_context": (CONFIG, dict(cp=2)),
    }
    for name, (config, kwargs) in cases.items():
        mesh = parallel.make_mesh(4 if "cp" in kwargs else 8, 1, cp=kwargs.pop("cp", 1))
        try:
            gpt_parallel.param_specs(config, parallel.MeshAxes.of(mesh, **kwargs), mesh.shape)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def main(out: str, only: list[str]) -> None:
    """Every case, or those named after OUT.json (for debugging one)."""
    cases = {f"layer-k{k}-c{c}": functools.partial(layer, k, c) for k, c in ((2, None), (1, 1.0), (2, 0.5))}
    cases["gpt-dp8-ep"] = functools.partial(gpt_training, 8, 1, True)
    cases["gpt-dp4-tp2-ep"] = functools.partial(gpt_training, 4, 2, True)
    cases["gpt-dp8"] = functools.partial(gpt_training, 8, 1, False)  # experts replicated: data parallelism
    cases["gpt-dp4-tp2-fsdp-ep"] = functools.partial(gpt_training, 4, 2, True, True)
    cases["errors"] = errors
    results = {name: case() for name, case in cases.items() if not only or name in only}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
