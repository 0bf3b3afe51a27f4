"""Child process for test_ring_attention.py: ring attention on 2, 4 and 8 simulated CPU devices (XLA_FLAGS must
be set before jax is imported; the test process has one device). Writes what it measured to a JSON file.

    python ring_child.py OUT.json
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

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
from purejax.parallel import MeshAxes, context  # noqa: E402
from purejax.parallel.ring_attention import ring_attention  # noqa: E402
from tests.purejax.parallel.hlo import executed_collectives  # noqa: E402

AXIS = "context"
BATCH, N_HEAD, N_KV_HEAD, HEAD_DIM = 2, 4, 2, 8  # grouped-query: two query heads per key/value head


def qkv(seq: int, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, seq, N_HEAD, HEAD_DIM)] + [(BATCH, seq, N_KV_HEAD, HEAD_DIM)] * 2
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def numpy_causal_attention(q, k, v) -> np.ndarray:
    """The reference, in float64 numpy: softmax over the full (seq x seq) causal score matrix."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group, seq = q.shape[2] // k.shape[2], q.shape[1]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", probs / probs.sum(-1, keepdims=True), v)


def dense_causal_attention(q, k, v):
    """One device's attention, differentiated by JAX: the reference for the gradients."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def sharded_ring(n: int, zigzag: bool):
    """`ring_attention` under shard_map over the first n devices: q, k, v and the output in ring order."""
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    return jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name=AXIS, zigzag=zigzag),
        mesh=mesh,
        in_specs=P(None, AXIS),
        out_specs=P(None, AXIS),
    )


def ring_fn(n: int, seq: int, zigzag: bool):
    """Whole-sequence attention through the ring on n devices: reorder, shard_map, order back."""
    ring = sharded_ring(n, zigzag)

    def attend(q, k, v):
        ordered = [context.to_ring_order(x, n, zigzag=zigzag) for x in (q, k, v)]
        return context.from_ring_order(ring(*ordered), n, seq, zigzag=zigzag)

    return attend


@functools.partial(jax.jit, static_argnums=0)
def output_and_grads(attend, q, k, v, w):
    """attend(q, k, v) and the gradients of sum(w * attend(q, k, v)), in one program."""
    y, vjp = jax.vjp(attend, q, k, v)
    return y, vjp(w)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# (n, zig-zag, seq): each n with and without zig-zag; seq 32 divides into the blocks, 13 does not (padded)
CASES = [(2, True, 32), (2, False, 13), (4, True, 13), (4, False, 32), (8, True, 13), (8, False, 13)]


def equivalence() -> dict:
    """Forward against float64 numpy; gradients of a weighted sum against one device's (`dense_causal_attention`)."""
    out = {}
    for n, zigzag, seq in CASES:
        q, k, v = qkv(seq)
        w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
        y, grads = output_and_grads(ring_fn(n, seq, zigzag), q, k, v, w)
        _, ref_vjp = jax.vjp(dense_causal_attention, q, k, v)
        out[f"n{n}-{'zigzag' if zigzag else 'contiguous'}-s{seq}"] = {
            "out_rel_err": rel_err(y, numpy_causal_attention(q, k, v)),
            "grad_rel_err": {name: rel_err(g, r) for name, g, r in zip("qkv", grads, ref_vjp(w))},
        }
    return out


def counted(hlo: str, n: int) -> dict[str, dict[str, int]]:
    """`executed_collectives` keyed "<kind>@<axes>" (JSON-friendly)."""
    return {f"{kind}@{'+'.join(axes)}": c for (kind, axes), c in executed_collectives(hlo, {AXIS: n}).items()}


def collectives(n: int = 4, seq: int = 32) -> dict:
    """Collectives one device executes in the ring (inputs already in ring order), forward alone and forward
    + backward (the cotangent given, so that no loss reduction adds its own), with the sizes they move."""
    q, k, v = qkv(seq)
    ring, w = sharded_ring(n, zigzag=True), jnp.ones_like(q)
    forward = jax.jit(ring).lower(q, k, v).compile().as_text()
    backward = output_and_grads.lower(ring, q, k, v, w).compile().as_text()
    return {
        "n": n,
        "kv_block_elements": 2 * BATCH * (seq // n) * N_KV_HEAD * HEAD_DIM,  # k and v of one device's block
        "forward": counted(forward, n),
        "backward": counted(backward, n),
    }


def memory(seq: int = 256) -> dict:
    """XLA's compiled memory analysis of the ring's forward + backward on one device's share, for n = 1 and 4:
    the temporaries (scores, probabilities kept for the backward pass) and the arguments."""
    out = {}
    for n in (1, 4):
        q, k, v = qkv(seq)
        analysis = output_and_grads.lower(sharded_ring(n, zigzag=True), q, k, v, q).compile().memory_analysis()
        out[str(n)] = {"temp_bytes": analysis.temp_size_in_bytes, "argument_bytes": analysis.argument_size_in_bytes}
    return out


GPT = gpt.GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, dropout=0.1)
# (dp, cp, tp, fsdp): 4-way context parallelism with fully sharded data parallelism, 2-way with both data and
# tensor parallelism (plain dp x cp is train.gpt's test)
GPT_MESHES = [(2, 4, 1, True), (2, 2, 2, False)]
OPTIMIZER = optim.sgd(1.0)  # one step: new params = params - gradients, so both are checked in one program


def gpt_loss_fn(axes: MeshAxes | None):
    """A train_step loss_fn without dropout (key unused): the ring has none."""
    return lambda params, batch, key: (gpt_parallel.loss(params, batch, GPT, axes=axes), {})


def gpt_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=GPT), jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)
    idx = rng.integers(0, GPT.vocab_size, (4, GPT.block_size))
    targets = rng.integers(0, GPT.vocab_size, (4, GPT.block_size))
    targets[0, :10], targets[3, 5:] = -1, -1  # ignored targets, unevenly spread over the devices
    return params, (jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def gpt_case(dp: int, cp: int, tp: int, fsdp: bool, params, batch, reference) -> dict:
    """One sharded SGD step of the GPT on a (dp, cp, tp) mesh, the batch in zig-zag order: its loss, its
    gradients (params - new params) and the new params."""
    mesh = parallel.make_mesh(dp, tp, jax.devices()[: dp * cp * tp], cp=cp)
    axes = MeshAxes.of(mesh, fsdp=fsdp)
    specs, batch_spec = gpt_parallel.param_specs(GPT, axes, mesh.shape), P(axes.data, axes.context)
    batch = tuple(context.to_ring_order(x, cp, zigzag=True) for x in batch)
    state = optim.init_train_state(params, OPTIMIZER, jax.random.key(0))
    state_specs = parallel.state_specs(state, specs)
    step = parallel.sharded_train_step(mesh, state_specs, batch_spec, loss_fn=gpt_loss_fn(axes), optimizer=OPTIMIZER)
    stepped, metrics = step(parallel.shard(state, state_specs, mesh), batch)
    result = {
        "loss_rel_err": rel_err(metrics["loss"], reference["loss"]),
        "grad_rel_err": rel_err(flat(params) - flat(stepped.params), flat(reference["grads"])),
        "step_params_rel_err": rel_err(flat(stepped.params), flat(reference["params"])),
    }
    with_key = jax.shard_map(
        lambda p, b: gpt_parallel.loss(p, b, GPT, key=jax.random.key(0), axes=axes),
        mesh=mesh,
        in_specs=(specs, batch_spec),
        out_specs=P(),
    )
    try:
        jax.eval_shape(with_key, params, batch)
    except ValueError as e:
        result["dropout_error"] = str(e)
    too_long = tuple(jnp.concatenate([x, x], axis=1) for x in batch)  # each device's share fits, the whole not
    try:
        jax.eval_shape(
            jax.shard_map(
                lambda p, b: gpt_loss_fn(axes)(p, b, None)[0], mesh=mesh, in_specs=(specs, batch_spec), out_specs=P()
            ),
            params,
            too_long,
        )
    except ValueError as e:
        result["length_error"] = str(e)
    return result


def gpt_equivalence() -> dict:
    """A sharded SGD step of gpt_parallel.loss (gradients summed over data and context) on each of GPT_MESHES,
    against gpt.loss, its gradients and optim.train_step on one device."""
    params, batch = gpt_data()
    loss, grads = jax.value_and_grad(lambda p: gpt_loss_fn(None)(p, batch, None)[0])(params)
    single = jax.jit(functools.partial(optim.train_step, loss_fn=gpt_loss_fn(None), optimizer=OPTIMIZER))
    stepped, _ = single(optim.init_train_state(params, OPTIMIZER, jax.random.key(0)), batch)
    reference = {"loss": loss, "grads": grads, "params": stepped.params}
    return {
        f"{dp}x{cp}x{tp}" + ("-fsdp" if fsdp else ""): gpt_case(dp, cp, tp, fsdp, params, batch, reference)
        for dp, cp, tp, fsdp in GPT_MESHES
    }


if __name__ == "__main__":
    results = {}
    for part in (equivalence, collectives, memory, gpt_equivalence):
        start = time.perf_counter()
        results[part.__name__] = part()
        print(f"{part.__name__}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
