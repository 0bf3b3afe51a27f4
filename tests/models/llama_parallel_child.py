"""Child process for test_llama_parallel.py: 8 simulated CPU devices (XLA_FLAGS must be set before jax is
imported; the test process has one device). Runs models.llama_parallel on several meshes, compares each
with the single-device llama.py, and writes the numbers to a JSON file that the tests assert on.

    python llama_parallel_child.py OUT.json
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

from models import llama, llama_parallel  # noqa: E402
from purejax import parallel  # noqa: E402
from purejax import tree as tree_lib  # noqa: E402
from purejax.parallel import DATA, MeshAxes  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

CONFIG = llama.LlamaConfig(
    vocab_size=64, n_layer=2, n_head=8, n_kv_head=4, d_model=32, d_ff=48, max_seq_len=16, rope_theta=500.0
)
# (name, dp, tp, fsdp, n_kv_head, tie_embeddings): kv heads split with their queries (4 on 4 devices, 4 on 2)
# and replicated (1 on 8; 2 on 4, under FSDP), the head tied and not.
MODES = [
    ("2x4-kv4", 2, 4, False, 4, False),
    ("1x8-kv1-tied", 1, 8, False, 1, True),
    ("2x4-kv2-fsdp", 2, 4, True, 2, False),
    ("4x2-kv4-fsdp-tied", 4, 2, True, 4, True),
]


def make_params(config: llama.LlamaConfig, seed: int = 0) -> llama.Params:
    """Random params from numpy: every weight and RMSNorm scale non-trivial."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(llama.init, config=config), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)


def make_batch(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, CONFIG.vocab_size, (8, CONFIG.max_seq_len))
    targets = rng.integers(0, CONFIG.vocab_size, (8, CONFIG.max_seq_len))
    targets[0, :10] = -1  # ignored positions, unevenly spread over the data shards
    targets[5, 3:] = -1
    return jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def equivalence(batch) -> dict:
    """Loss and gradients (`jax.grad` under a plain shard_map) on every mesh of MODES against one device's,
    whether each gradient comes back split like its param, and the collectives over the model axis."""
    out = {}
    for name, dp, tp, fsdp, n_kv_head, tie in MODES:
        config = dataclasses.replace(CONFIG, n_kv_head=n_kv_head, tie_embeddings=tie)
        params = make_params(config)
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(functools.partial(llama.loss, config=config)))(params, batch)
        mesh = parallel.make_mesh(dp, tp)
        axes = MeshAxes.of(mesh, fsdp=fsdp)
        specs = llama_parallel.param_specs(config, axes, mesh.shape)
        grad_fn = jax.value_and_grad(functools.partial(llama_parallel.loss, config=config, axes=axes))
        sharded = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(specs, P(axes.data)), out_specs=(P(), specs)))
        placed = parallel.shard(params, specs, mesh)
        compiled = sharded.lower(placed, batch).compile()
        loss, grads = compiled(placed, batch)
        flat, ref_flat = tree_lib.flatten(grads), tree_lib.flatten(ref_grads)
        want = {p: jax.sharding.NamedSharding(mesh, s) for p, s in zip(flat, jax.tree.leaves(specs))}
        counts = executed_collectives(compiled.as_text(), dict(mesh.shape))
        out[name] = {
            "loss_rel_err": rel_err(loss, ref_loss),
            "grad_rel_err": {path: rel_err(flat[path], ref_flat[path]) for path in ref_flat},
            "grads_misplaced": [p for p, g in flat.items() if not g.sharding.is_equivalent_to(want[p], g.ndim)],
            "qkv_spec": str(tree_lib.flatten(specs)["blocks.attn.qkv.w"]),
            **{
                f"{kind}@model": counts.get((kind, ("model",)), {"ops": 0})["ops"]
                for kind in ("all-gather", "reduce-scatter")
            },
        }
    return out


def errors(batch) -> dict:
    """Whole (unsharded) params passed with replicated specs: the model notices they are not its shards."""
    mesh = parallel.make_mesh(2, 4)
    axes = MeshAxes.of(mesh)
    specs = llama_parallel.param_specs(CONFIG, axes, mesh.shape)
    replicated = jax.tree.map(lambda s: P(), specs, is_leaf=lambda x: isinstance(x, P))
    try:
        jax.shard_map(
            functools.partial(llama_parallel.loss, config=CONFIG, axes=axes),
            mesh=mesh,
            in_specs=(replicated, P(DATA)),
            out_specs=P(),
        )(make_params(CONFIG), batch)
    except Exception as e:  # the message is what is tested
        return {"unsharded_params": str(e)}
    return {"unsharded_params": "no error"}


def main(path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = make_batch()
    results = {"equivalence": equivalence(batch), "errors": errors(batch)}
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
