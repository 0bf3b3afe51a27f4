"""models.gpt against an independent float64 numpy GPT: the forward pass, the loss, causality, scan against
loop, dropout keys, the initialisation, dtype policies, accounting, tensor parallelism's axis, and every error.
Decoding is tested in test_gpt_decode.py, surgery in test_gpt_surgery.py, the mesh in test_gpt_parallel.py and
tests/purejax/parallel/."""

import dataclasses
import functools
import math
from functools import partial

import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt, gpt_flops
from purejax import tree as tree_lib
from purejax.precision import Policy, with_policy
from tests.purejax.nn.test_stack import _has_scan
from train.gpt_settings import GPTSettings

CONFIG = gpt.GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=4, n_embd=32, layers="scan")  # not "auto"
LOOP = dataclasses.replace(CONFIG, layers="loop")
B = 2

# jitted once per (config, shapes); eager dispatch would compile every primitive separately
apply = jax.jit(gpt.apply, static_argnums=2)
loss = jax.jit(gpt.loss, static_argnums=2)
init = jax.jit(gpt.init, static_argnums=1)
value_and_grad = jax.jit(jax.value_and_grad(gpt.loss), static_argnums=2)


@jax.jit
def add_noise(params, key):
    """params + N(0, 0.1^2) noise from one draw, so biases, LayerNorm shifts and every weight are non-trivial."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    return unravel(flat + 0.1 * jax.random.normal(key, flat.shape))


@functools.cache  # params are immutable: tests share them
def make_params(seed=0):
    return add_noise(init(jax.random.key(seed), CONFIG), jax.random.key(seed + 100))


def without_biases(params):
    """The params of CONFIG with bias=False: the same tree less every linear and LayerNorm bias."""
    return tree_lib.unflatten({p: a for p, a in tree_lib.flatten(params).items() if not p.endswith((".b", ".bias"))})


def tokens(shape, seed=1, vocab=CONFIG.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def numpy_forward(params, idx, config):
    """GPT in float64 numpy, written from the paper's description: per-head attention with -inf masking."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    idx = np.asarray(idx)
    b, t = idx.shape
    n, d = config.n_head, config.n_embd // config.n_head

    def layer_norm(x, q):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * q["scale"] + q.get("bias", 0.0)

    def linear(x, q):
        return x @ q["w"] + q.get("b", 0.0)

    def gelu(x):
        if config.gelu == "tanh":
            return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))

    x = p["wte"]["w"][idx] + p["wpe"]["w"][:t]
    for layer in range(config.n_layer):
        q = jax.tree.map(lambda a, layer=layer: a[layer], p["blocks"])
        qkv = linear(layer_norm(x, q["ln_1"]), q["attn"]["qkv"]).reshape(b, t, n, 3, d)  # per head: q, k, v
        heads = [qkv[:, :, :, j].transpose(0, 2, 1, 3) for j in range(3)]
        logits = heads[0] @ heads[1].transpose(0, 1, 3, 2) / np.sqrt(d)
        logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        y = (weights @ heads[2]).transpose(0, 2, 1, 3).reshape(b, t, n * d)
        x = x + linear(y, q["attn"]["proj"])
        x = x + linear(gelu(linear(layer_norm(x, q["ln_2"]), q["mlp"]["fc"])), q["mlp"]["proj"])
    return layer_norm(x, p["ln_f"]) @ p["wte"]["w"].T


# ---------------------------------------------------------------- the forward pass


@pytest.mark.parametrize(
    "config",
    [CONFIG, LOOP, dataclasses.replace(CONFIG, gelu="tanh", bias=False, attention_impl="einsum")],
    ids=["scan", "loop", "tanh-nobias-einsum"],
)
def test_forward_matches_numpy(config):
    params = make_params() if config.bias else without_biases(make_params())
    idx = tokens((B, config.block_size))
    logits = apply(params, idx, config)
    chex.assert_shape(logits, (B, config.block_size, config.vocab_size))
    np.testing.assert_allclose(logits, numpy_forward(params, idx, config), rtol=1e-4, atol=1e-4)


def test_loss_is_mean_cross_entropy_ignoring_minus_one():
    params = make_params()
    idx, targets = tokens((B, 8), seed=2), np.array(tokens((B, 8), seed=3))
    targets[0, :3] = -1  # padding, as nanoGPT's ignore_index=-1
    logits = numpy_forward(params, idx, CONFIG)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    valid = targets != -1
    expected = -np.take_along_axis(log_probs, np.where(valid, targets, 0)[..., None], -1)[..., 0][valid].mean()
    value = loss(params, (idx, jnp.asarray(targets)), CONFIG)
    assert value.dtype == jnp.float32 and value.shape == ()
    np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_causality_a_future_token_never_changes_earlier_logits():
    params = make_params()
    idx = tokens((B, 8))
    logits = apply(params, idx, CONFIG)
    for t in range(8):
        changed = apply(params, idx.at[:, t].set((idx[:, t] + 1) % CONFIG.vocab_size), CONFIG)
        np.testing.assert_array_equal(changed[:, :t], logits[:, :t])
        assert not np.allclose(changed[:, t], logits[:, t])


# ---------------------------------------------------------------- scan and loop, dropout and keys

DROPOUT = dataclasses.replace(CONFIG, dropout=0.2)
BATCH = (tokens((B, 8)), tokens((B, 8), seed=5))


def test_scan_and_loop_agree_in_values_and_gradients_with_dropout():
    """The same maths both ways, dropout masks included (each layer's key is fold_in(key, layer) either way).
    Not bit-identical: XLA fuses the unrolled loop differently, so they agree to float32 rounding."""
    params, key = make_params(), jax.random.key(7)
    v_scan, g_scan = value_and_grad(params, BATCH, DROPOUT, key=key)
    v_loop, g_loop = value_and_grad(params, BATCH, dataclasses.replace(DROPOUT, layers="loop"), key=key)
    np.testing.assert_allclose(v_scan, v_loop, rtol=1e-6)
    chex.assert_trees_all_close(g_scan, g_loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("n_layer", "remat", "scans"), [(4, "none", False), (12, "none", True), (4, "block", True)])
def test_the_default_layers_auto_loops_shallow_stacks_and_scans_deep_or_rematerialised_ones(n_layer, remat, scans):
    """GPTConfig() and the training program's GPTSettings() default to layers="auto" (`stack.resolve`): 4 layers
    unrolled (no scan in the program), 12 layers, or 4 rematerialised, under a scan. Traced, never compiled."""
    small = dict(block_size=8, n_head=2, n_embd=16, n_layer=n_layer, remat=remat)
    idx = jnp.zeros((2, 8), jnp.int32)
    for config in (gpt.GPTConfig(vocab_size=16, **small), GPTSettings(**small).model_config(vocab_size=16)):
        params = jax.eval_shape(partial(gpt.init, config=config), jax.random.key(0))
        assert _has_scan(lambda p, c=config: gpt.loss(p, (idx, idx), c), params) == scans, config


def test_dropout_is_on_only_with_a_key_and_is_reproducible():
    params = make_params()
    evaluation = loss(params, BATCH, DROPOUT)
    np.testing.assert_array_equal(evaluation, loss(params, BATCH, CONFIG))  # no key: the rate does not matter
    a, again, other = (value_and_grad(params, BATCH, DROPOUT, key=jax.random.key(i))[0] for i in (7, 7, 8))
    assert a == again and a != other and a != evaluation


def test_a_key_without_dropout_changes_nothing():
    params, idx = make_params(), tokens((B, 8))
    np.testing.assert_array_equal(apply(params, idx, CONFIG, key=jax.random.key(3)), apply(params, idx, CONFIG))


def test_parts_are_initialised_from_their_own_keys():
    """Named keys: changing the depth leaves wte, wpe and the shared layers as they were; another key
    changes every weight, and the layers differ from each other."""
    a = init(jax.random.key(0), CONFIG)
    deeper = init(jax.random.key(0), dataclasses.replace(CONFIG, n_layer=3))
    chex.assert_trees_all_equal(a["wte"], deeper["wte"])
    chex.assert_trees_all_equal(a["wpe"], deeper["wpe"])
    # layer i's key is fold_in(key, i), so the first two layers are the same; the residual projections'
    # std depends on n_layer (0.02 / sqrt(2 n_layer)), so those are the same up to that scale
    np.testing.assert_array_equal(a["blocks"]["attn"]["qkv"]["w"], deeper["blocks"]["attn"]["qkv"]["w"][:2])
    proj, deeper_proj = a["blocks"]["mlp"]["proj"]["w"], deeper["blocks"]["mlp"]["proj"]["w"]
    np.testing.assert_allclose(proj * math.sqrt(4 / 6), deeper_proj[:2], rtol=1e-6)
    other = init(jax.random.key(1), CONFIG)
    for path, leaf in tree_lib.flatten(other).items():
        if np.std(leaf) > 0:  # weights, not the constant LayerNorm scales and zero biases
            assert not np.array_equal(leaf, tree_lib.flatten(a)[path]), path
    assert not np.array_equal(a["blocks"]["attn"]["qkv"]["w"][0], a["blocks"]["attn"]["qkv"]["w"][1])


def test_initialisation_statistics_are_nanogpts():
    """N(0, 0.02) everywhere except the residual projections at 0.02 / sqrt(2 n_layer); zero biases, unit
    LayerNorm scales. The tolerance is four standard errors of the sample std, 1 / sqrt(2 n)."""
    n_layer = 3
    flat = tree_lib.flatten(init(jax.random.key(0), dataclasses.replace(CONFIG, n_layer=n_layer)))
    for path, leaf in flat.items():
        leaf = np.asarray(leaf, np.float64)
        if path.endswith((".b", ".bias")):
            np.testing.assert_array_equal(leaf, 0.0, err_msg=path)
        elif path.endswith(".scale"):
            np.testing.assert_array_equal(leaf, 1.0, err_msg=path)
        else:
            want = 0.02 / math.sqrt(2 * n_layer) if path in ("blocks.attn.proj.w", "blocks.mlp.proj.w") else 0.02
            assert abs(leaf.mean()) < 4 * want / math.sqrt(leaf.size), path
            np.testing.assert_allclose(leaf.std(), want, rtol=4 / math.sqrt(2 * leaf.size), err_msg=path)


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize(
    "compute, config",
    # float16 with attention_impl="einsum": jax.nn.dot_product_attention (the "fused" formulation) fails to
    # compile in float16 on XLA:CPU ("precision F16_F16_F32 is not supported by dot_general on CPU")
    [("bfloat16", CONFIG), ("float16", dataclasses.replace(CONFIG, attention_impl="einsum"))],
    ids=["bfloat16", "float16"],
)
def test_a_low_precision_policy_runs_close_to_float32(compute, config):
    params, idx = make_params(), tokens((B, 8))
    policy = Policy.from_string(f"params=float32,compute={compute},output=float32")
    low = jax.jit(with_policy(gpt.apply, policy), static_argnums=2)(params, idx, config)
    assert low.dtype == jnp.float32
    full = apply(params, idx, CONFIG)
    tolerance = {"bfloat16": 0.1, "float16": 0.02}[compute] * float(jnp.std(full))
    assert float(jnp.max(jnp.abs(low - full))) < tolerance
    assert not np.array_equal(low, full)  # it really ran in low precision


# ---------------------------------------------------------------- surgery and accounting


def test_parameter_counts_match_nanogpts_gpt2_small():
    """nanoGPT prints 'number of parameters: 123.69M' for GPT-2 small with the padded vocabulary (50304),
    and GPT-2 small has 124,439,808 parameters in all with 50257 (the Hugging Face count)."""
    small = gpt.GPTConfig()  # nanoGPT's defaults are GPT-2 small
    shapes = jax.eval_shape(partial(gpt.init, config=small), jax.random.key(0))
    assert gpt_flops.num_params(shapes) == 123_689_472
    hf_small = dataclasses.replace(small, vocab_size=50257)
    hf_shapes = jax.eval_shape(partial(gpt.init, config=hf_small), jax.random.key(0))
    assert gpt_flops.num_params(hf_shapes, non_embedding=False) == 124_439_808


def test_flops_and_mfu_follow_nanogpts_formula():
    small = gpt.GPTConfig()
    per_token = 6 * 123_689_472 + 12 * 12 * 12 * 64 * 1024
    assert gpt_flops.flops_per_token(small) == per_token
    # nanoGPT's estimate_mfu: batch 12 x 1024 tokens per iteration at 1 s, against an A100's 312 TFLOP/s
    np.testing.assert_allclose(gpt_flops.estimate_mfu(small, 12 * 1024, 312e12), per_token * 12 * 1024 / 312e12)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        gpt_flops.estimate_mfu(small, 1000.0, 0.0)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_embd=30, n_head=4), "n_embd=30 is not divisible by n_head=4"),
        (dict(n_layer=0), "n_layer must be a positive int"),
        (dict(vocab_size=-3), "vocab_size must be a positive int"),
        (dict(block_size=True), "block_size must be a positive int"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        # the Literal fields: beartype names the field in the tests, our check does without it
        (dict(gelu="relu"), "gelu"),
        (dict(layers="vmap"), "layers"),
        (dict(attention_impl="flash"), "impl"),
        (dict(attention_impl="fused", dropout=0.1), "impl='fused' cannot drop attention probabilities"),
    ],
)
def test_impossible_configs_are_rejected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        dataclasses.replace(CONFIG, **kwargs)


def test_key_is_keyword_only_and_apply_returns_logits_alone():
    """The layer contract: randomness only from a keyword `key`; one return type (decoding: gpt_decode)."""
    params, key = make_params(), jax.random.key(0)
    with pytest.raises(TypeError):
        gpt.loss(params, BATCH, DROPOUT, key)  # a positional key is refused
    assert isinstance(apply(params, BATCH[0], DROPOUT, key=key), jax.Array)


def test_bad_inputs_are_rejected_with_what_is_wrong():
    params = make_params()
    with pytest.raises(ValueError, match="cannot forward a sequence of length 9, block_size is only 8"):
        gpt.apply(params, tokens((B, 9)), CONFIG)
    with pytest.raises(TypeError):  # a float "token id": the annotation (or the explicit check) rejects it
        gpt.apply(params, jnp.zeros((B, 4)), CONFIG)
    with pytest.raises(ValueError, match=r"params do not fit the config.*wpe \(8, 32\).*n_layer=3"):
        gpt.apply(params, tokens((B, 4)), dataclasses.replace(CONFIG, n_layer=3))
    with pytest.raises(KeyError, match=r"missing keys \['ln_f'\]"):
        gpt.apply({k: v for k, v in params.items() if k != "ln_f"}, tokens((B, 4)), CONFIG)
