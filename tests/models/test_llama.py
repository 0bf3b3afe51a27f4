"""models.llama against the float64 numpy Llama of llama_numpy.py (multi-head, grouped-query and
multi-query attention; tied and untied heads; rotary scaling), scan against loop, the loss, and the errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import llama, llama_flops
from models.llama import LlamaConfig
from purejax import tree
from purejax.nn import rotary
from tests.models import llama_numpy

CONFIG = LlamaConfig(vocab_size=13, n_layer=2, n_head=4, n_kv_head=2, d_model=16, d_ff=24, max_seq_len=12)
IDX = np.random.default_rng(0).integers(0, 13, size=(2, 7))


def make_params(config, seed=0):
    """init's params with the RMSNorm scales moved off 1, so that a wrong norm cannot pass unseen."""
    params = llama.init(jax.random.key(seed), config)
    rng = np.random.default_rng(seed)
    flat = tree.flatten(params)
    return tree.unflatten(
        {
            p: a + rng.normal(size=a.shape).astype(np.float32) * 0.2 if p.endswith("scale") else a
            for p, a in flat.items()
        }
    )


CASES = {
    "multi-head": dict(n_kv_head=4),
    "grouped": dict(n_kv_head=2, rope_scaling=rotary.Llama3Scaling(4.0, 1.0, 4.0, 8)),
    "multi-query, tied": dict(n_kv_head=1, tie_embeddings=True, rope_scaling=rotary.LinearScaling(2.0)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_logits_match_the_float64_numpy_llama(case):
    config = dataclasses.replace(CONFIG, rope_theta=500.0, **CASES[case])
    params = make_params(config)
    want = llama_numpy.forward(params, IDX, config)
    np.testing.assert_allclose(llama.apply(params, IDX, config), want, rtol=1e-4, atol=1e-5)
    assert ("head" in params) != config.tie_embeddings


def test_params_layout():
    shapes = {path: a.shape for path, a in tree.flatten(llama.init(jax.random.key(0), CONFIG)).items()}
    assert shapes == {
        "embed.w": (13, 16),
        "head.w": (16, 13),
        "norm.scale": (16,),
        "blocks.attn_norm.scale": (2, 16),
        "blocks.mlp_norm.scale": (2, 16),
        "blocks.attn.qkv.w": (2, 16, (4 + 2 * 2) * 4),
        "blocks.attn.proj.w": (2, 16, 16),
        "blocks.mlp.gate.w": (2, 16, 24),
        "blocks.mlp.up.w": (2, 16, 24),
        "blocks.mlp.down.w": (2, 24, 16),
    }
    tied = llama.init(jax.random.key(0), dataclasses.replace(CONFIG, tie_embeddings=True))
    assert "head" not in tied
    assert llama_flops.num_params(tied) == tree.count(tied)  # the tied table is the head: counted
    params = llama.init(jax.random.key(0), CONFIG)
    assert llama_flops.num_params(params) == tree.count(params) - 13 * 16
    assert llama_flops.num_params(params, non_embedding=False) == tree.count(params)


def test_flops_per_token_counts_every_matmul_six_times_plus_attention():
    """6 FLOPs per parameter per token (2 forward, 4 backward) for each matmul weight, counted by hand from
    the shapes above: four attention/MLP projections and the head; plus attention's 12 * L * H * hd * T."""
    per_layer = 16 * (4 + 2 * 2) * 4 + 16 * 16 + 3 * 16 * 24 + 2 * 16  # qkv, proj, gate/up/down, two norms
    matmul_params = 2 * per_layer + 16 * 13 + 16  # the head and the final norm (the lookup costs nothing)
    attention = 12 * CONFIG.n_layer * CONFIG.n_head * CONFIG.head_dim * CONFIG.max_seq_len
    assert llama_flops.flops_per_token(CONFIG) == 6 * matmul_params + attention


def test_scan_and_loop_agree():
    params = make_params(CONFIG)
    scan = jax.jit(llama.apply, static_argnames="config")(params, IDX, CONFIG)
    loop = jax.jit(llama.apply, static_argnames="config")(params, IDX, dataclasses.replace(CONFIG, layers="loop"))
    np.testing.assert_allclose(scan, loop, rtol=1e-5, atol=1e-6)


def test_a_shifted_sequence_gives_the_same_hidden_states():
    """Rotary makes attention depend on position differences only: the whole sequence moved by 5 positions
    computes the same thing (to float32 rounding of the larger angles)."""
    params = make_params(CONFIG)
    moved = llama.hidden(params, IDX, CONFIG, positions=np.arange(5, 12))
    np.testing.assert_allclose(moved, llama.hidden(params, IDX, CONFIG), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        llama.unembed(params, moved, CONFIG),
        llama_numpy.forward(params, IDX, CONFIG, positions=np.arange(5, 12)),
        rtol=1e-4,
        atol=1e-5,
    )


def test_loss_is_the_mean_cross_entropy_of_the_counted_targets():
    params = make_params(CONFIG)
    targets = np.roll(IDX, -1, axis=1)
    targets[:, -1] = -1
    logits = llama_numpy.forward(params, IDX, CONFIG)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets[:, :-1])
    np.testing.assert_allclose(llama.loss(params, (IDX, targets), CONFIG), np.mean(per_token), rtol=1e-5)
    grads = jax.jit(jax.grad(llama.loss), static_argnames="config")(params, (IDX, targets), CONFIG)
    assert all(np.isfinite(g).all() and np.any(g) for g in jax.tree.leaves(grads))


def test_config_errors():
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        LlamaConfig(n_head=4, n_kv_head=3, d_model=16)
    with pytest.raises(ValueError, match="heads of an even width"):
        LlamaConfig(n_head=4, n_kv_head=4, d_model=12)  # head_dim 3
    with pytest.raises(ValueError, match="d_ff must be a positive int"):
        LlamaConfig(d_ff=0)
    with pytest.raises((TypeError, ValueError), match="rope_scaling"):  # jaxtyping's check in the tests, else ours
        LlamaConfig(rope_scaling={"rope_type": "llama3"})
    with pytest.raises((TypeError, ValueError), match="impl"):
        LlamaConfig(attention_impl="flash")
    assert hash(CONFIG) == hash(dataclasses.replace(CONFIG))


def test_param_errors_name_the_path():
    params = llama.init(jax.random.key(0), CONFIG)
    flat = tree.flatten(params)
    bad = tree.unflatten({**flat, "blocks.mlp.up.w": flat["blocks.mlp.up.w"][..., :20]})
    with pytest.raises(ValueError, match=r"blocks.mlp.up.w: expected \(16, 24\), got \(16, 20\)"):
        llama.apply(bad, IDX, CONFIG)
    with pytest.raises(KeyError, match=r"missing keys \['head'\].*tie_embeddings=False"):
        llama.apply({k: v for k, v in params.items() if k != "head"}, IDX, CONFIG)
    with pytest.raises(ValueError, match=r"and 2 stacked blocks, but .* n_layer=3"):
        llama.apply(params, IDX, dataclasses.replace(CONFIG, n_layer=3))
    with pytest.raises(ValueError, match=r"seq <= max_seq_len=12"):
        llama.apply(params, np.zeros((1, 13), np.int32), CONFIG)
    with pytest.raises(TypeError, match="idx"):
        llama.apply(params, np.zeros((1, 3), np.float32), CONFIG)


def test_bfloat16_compute_stays_close():
    params = make_params(CONFIG)
    low = llama.apply(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), IDX, CONFIG)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), llama.apply(params, IDX, CONFIG), atol=0.05)
