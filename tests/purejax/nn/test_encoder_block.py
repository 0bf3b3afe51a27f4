"""purejax.nn.encoder_block: equal to the composition of layer_norm, attention and mlp written out here, and to
an independent numpy float64 block (values, and gradients against central finite differences); padding that
changes nothing, no causal mask, dropout only with a key, and errors that name the argument."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import attention, encoder_block, layer_norm, mlp
from purejax.nn.attention import AttentionConfig
from purejax.nn.encoder_block import EncoderBlockConfig
from tests.purejax.nn.finite_differences import gradient as finite_differences

B, T = 2, 5
CONFIG = EncoderBlockConfig(12, 3, d_ff=20)  # odd sizes: head_dim 4, d_ff not a multiple of d_model
PADDING = np.array([[True] * T, [True, True, True, False, False]])

apply = jax.jit(encoder_block.apply, static_argnums=2)


def make(config=CONFIG, seed=0):
    params = encoder_block.init(jax.random.key(seed), config)
    # every leaf perturbed (LayerNorm scales off one, biases off zero), so a misplaced one cannot hide
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(seed + 1), a.shape), params)
    x = np.random.default_rng(seed).normal(size=(B, T, config.d_model)).astype(np.float32)
    return params, x


def test_equals_the_composition_of_its_layers():
    params, x = make()
    attn_config = AttentionConfig(d_model=12, n_head=3, causal=False)
    padding = jnp.broadcast_to(jnp.asarray(PADDING)[:, None, None, :], (B, 1, T, T))  # True at real keys

    @jax.jit  # one compilation, not one per operation
    def composition(params, x):
        h = x + attention.apply(params["attn"], layer_norm.apply(params["ln_1"], x), attn_config, mask=padding)
        return h + mlp.apply(params["mlp"], layer_norm.apply(params["ln_2"], h))

    want = composition(params, x)
    np.testing.assert_allclose(apply(params, x, CONFIG, kv_mask=PADDING), want, rtol=1e-6, atol=1e-6)


def numpy_encoder_block(params, x, kv_mask=None, n_head=CONFIG.n_head):
    """The block in float64: LayerNorm (biased variance, eps 1e-5), attention over the qkv columns grouped per
    head ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]) with -inf at padded keys, exact-erf GELU."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    batch, seq, d = x.shape
    h_dim = d // n_head

    def norm(ln, a):
        mean, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
        return (a - mean) / np.sqrt(var + 1e-5) * ln["scale"] + ln["bias"]

    qkv = (norm(p["ln_1"], x) @ p["attn"]["qkv"]["w"] + p["attn"]["qkv"]["b"]).reshape(batch, seq, n_head, 3, h_dim)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(h_dim)
    if kv_mask is not None:
        logits = np.where(np.asarray(kv_mask)[:, None, None, :], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("bnts,bsnh->btnh", probs, v).reshape(batch, seq, d)
    x = x + attended @ p["attn"]["proj"]["w"] + p["attn"]["proj"]["b"]
    hidden = norm(p["ln_2"], x) @ p["mlp"]["fc"]["w"] + p["mlp"]["fc"]["b"]
    hidden = 0.5 * hidden * (1.0 + np.vectorize(math.erf)(hidden / math.sqrt(2.0)))
    return x + hidden @ p["mlp"]["proj"]["w"] + p["mlp"]["proj"]["b"]


@pytest.mark.parametrize("impl", ["fused", "einsum"])
def test_matches_numpy(impl):
    config = EncoderBlockConfig(12, 3, d_ff=20, impl=impl)
    params, x = make(config)
    np.testing.assert_allclose(apply(params, x, config), numpy_encoder_block(params, x), rtol=1e-5, atol=1e-5)
    got = apply(params, x, config, kv_mask=PADDING)
    np.testing.assert_allclose(got, numpy_encoder_block(params, x, PADDING), rtol=1e-5, atol=1e-5)


def test_gradients_match_finite_differences_of_numpy():
    config = EncoderBlockConfig(6, 2, d_ff=7, impl="einsum")
    params, x = make(config, seed=2)
    weights = np.random.default_rng(3).normal(size=x.shape)

    def loss(params, x):
        return jnp.sum(jnp.sin(encoder_block.apply(params, x, config, kv_mask=PADDING)) * weights)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    def numpy_loss(tree):
        return np.sum(np.sin(numpy_encoder_block(tree[0], tree[1], PADDING, n_head=2)) * weights)

    want = finite_differences(numpy_loss, (params, x))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-4, err_msg=jax.tree_util.keystr(path))


def test_padded_positions_do_not_influence_the_others():
    params, x = make()
    y = apply(params, x, CONFIG, kv_mask=PADDING)
    changed = x.copy()
    changed[1, 3:] = 50.0 * np.random.default_rng(9).normal(size=(2, CONFIG.d_model))  # row 1's padding
    y_changed = apply(params, changed, CONFIG, kv_mask=PADDING)
    np.testing.assert_array_equal(y_changed[0], y[0])
    np.testing.assert_allclose(y_changed[1, :3], y[1, :3], rtol=1e-6, atol=1e-6)
    assert not np.allclose(apply(params, changed, CONFIG)[1, :3], y[1, :3])  # without the mask it counts


def test_not_causal_a_later_token_changes_earlier_outputs():
    assert "causal" not in {f for f in EncoderBlockConfig.__dataclass_fields__}
    assert not CONFIG.attention.causal
    params, x = make()
    changed = x.copy()
    changed[:, -1] += np.random.default_rng(5).normal(size=(B, CONFIG.d_model))  # not a constant: LayerNorm hides one
    assert not np.allclose(apply(params, changed, CONFIG)[:, 0], apply(params, x, CONFIG)[:, 0])


def test_dropout_only_with_a_key():
    config = EncoderBlockConfig(12, 3, d_ff=20, dropout=0.2)
    params, x = make(config)
    evaluation = apply(params, x, config)
    np.testing.assert_array_equal(evaluation, apply(params, x, CONFIG))
    train = apply(params, x, config, key=jax.random.key(4))
    assert not np.allclose(train, evaluation)
    np.testing.assert_array_equal(train, apply(params, x, config, key=jax.random.key(4)))


def test_init_names_and_shapes():
    shapes = jax.tree.map(lambda a: a.shape, encoder_block.init(jax.random.key(0), CONFIG))
    assert set(shapes) == {"ln_1", "attn", "ln_2", "mlp"}
    assert shapes["attn"]["qkv"]["w"] == (12, 36) and shapes["mlp"]["fc"]["w"] == (12, 20)
    assert EncoderBlockConfig(8, 2).d_ff == 32
    no_bias = encoder_block.init(jax.random.key(0), EncoderBlockConfig(8, 2, bias=False))
    assert "bias" not in no_bias["ln_1"] and "b" not in no_bias["mlp"]["fc"]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="d_ff must be a positive int"):
        EncoderBlockConfig(8, 2, d_ff=0)
    with pytest.raises(ValueError, match="not divisible by n_head=3"):
        EncoderBlockConfig(8, 3)
    params, x = make()
    with pytest.raises((ValueError, TypeError), match="kv_mask"):
        encoder_block.apply(params, x, CONFIG, kv_mask=PADDING[:, :4])
    with pytest.raises(TypeError, match="kv_mask"):
        encoder_block.apply(params, x, CONFIG, kv_mask=PADDING.astype(np.int32))
    with pytest.raises(KeyError, match=r"encoder_block: params have missing keys \['mlp'\]"):
        encoder_block.apply({k: v for k, v in params.items() if k != "mlp"}, x, CONFIG)
    with pytest.raises(ValueError, match=r"x has shape \(2, 5, 8\)"):
        encoder_block.apply(params, x[..., :8], CONFIG)
