"""purejax.nn.cross_attention against an independent numpy float64 multi-head attention over two sequences:
different lengths and widths, key padding masks, grouped heads, both formulations, gradients against central
finite differences, dropout, and errors that name the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import cross_attention
from purejax.nn.cross_attention import CrossAttentionConfig
from tests.purejax.nn.finite_differences import gradient as finite_differences

B, T, S = 2, 3, 5  # batch, query length, context length: odd and unequal

apply = jax.jit(cross_attention.apply, static_argnums=3)


def make(config, seed=0):
    params = cross_attention.init(jax.random.key(seed), config)
    # non-zero biases, so a bias applied in the wrong place cannot hide
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(seed + 1), a.shape), params)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, config.d_model)).astype(np.float32)
    context = rng.normal(size=(B, S, config.d_context)).astype(np.float32)
    return params, x, context


def numpy_cross_attention(params, x, context, config, kv_mask=None):
    """Per head softmax(q k^T / sqrt(head_dim)) v in float64, -inf at masked keys; k and v read from the kv
    columns grouped per key/value head ([k_0 v_0 | k_1 v_1 | ...]), query head h reading kv head h // group."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x, context = np.asarray(x, np.float64), np.asarray(context, np.float64)
    n, kv, h = config.n_head, config.n_kv_head, config.head_dim
    q = (x @ p["q"]["w"] + p["q"].get("b", 0.0)).reshape(B, T, n, h)
    kv_columns = context @ p["kv"]["w"] + p["kv"].get("b", 0.0)
    out = np.zeros((B, T, n, h))
    for head in range(n):
        kv_head = head // (n // kv)
        k = kv_columns[..., 2 * kv_head * h : (2 * kv_head + 1) * h]
        v = kv_columns[..., (2 * kv_head + 1) * h : (2 * kv_head + 2) * h]
        logits = np.einsum("btd,bsd->bts", q[:, :, head], k) / np.sqrt(h)
        if kv_mask is not None:
            logits = np.where(np.asarray(kv_mask)[:, None, :], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, :, head] = np.einsum("bts,bsd->btd", probs, v)
    return out.reshape(B, T, n * h) @ p["proj"]["w"] + p["proj"].get("b", 0.0)


CONFIGS = [
    CrossAttentionConfig(8, 2, d_context=6),  # context narrower than the queries
    CrossAttentionConfig(12, 4, n_kv_head=2, d_context=7),  # grouped heads, odd widths
    CrossAttentionConfig(6, 3, n_kv_head=1, bias=False),  # multi-query, context as wide as x
]
PADDING = np.array([[True] * S, [True, True, False, True, False]])  # row 1: two padding positions


@pytest.mark.parametrize("impl", ["fused", "einsum"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_numpy_with_and_without_a_padding_mask(config, impl):
    config = CrossAttentionConfig(**{**config.__dict__, "impl": impl})
    params, x, context = make(config)
    y = apply(params, x, context, config)
    assert y.shape == (B, T, config.d_model)
    np.testing.assert_allclose(y, numpy_cross_attention(params, x, context, config), rtol=1e-5, atol=1e-5)
    y = apply(params, x, context, config, kv_mask=PADDING)
    want = numpy_cross_attention(params, x, context, config, PADDING)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_padded_context_positions_change_nothing():
    config = CrossAttentionConfig(8, 2, d_context=6)
    params, x, context = make(config)
    y = apply(params, x, context, config, kv_mask=PADDING)
    changed = context.copy()
    changed[1, [2, 4]] += 100.0  # only the padding of row 1
    np.testing.assert_array_equal(apply(params, x, changed, config, kv_mask=PADDING), y)
    assert not np.allclose(apply(params, x, changed, config), y)  # without the mask they count


def test_a_fully_padded_row_is_finite():
    config = CrossAttentionConfig(8, 2, d_context=6)
    params, x, context = make(config)
    y = apply(params, x, context, config, kv_mask=np.array([[True] * S, [False] * S]))
    assert np.isfinite(y).all()


def test_gradients_match_finite_differences_of_numpy():
    config = CrossAttentionConfig(8, 4, n_kv_head=2, d_context=5, impl="einsum")  # grouped heads, odd widths
    params, x, context = make(config, seed=3)
    weights = np.random.default_rng(4).normal(size=(B, T, config.d_model))

    def loss(params, x, context):
        return jnp.sum(jnp.sin(cross_attention.apply(params, x, context, config, kv_mask=PADDING)) * weights)

    got_params, got_x, got_context = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, context)

    def numpy_loss(values):
        out = numpy_cross_attention(values["params"], values["x"], values["context"], config, PADDING)
        return np.sum(np.sin(out) * weights)

    inputs = {"params": params, "x": x, "context": context}
    want = finite_differences(numpy_loss, inputs)
    got = {"params": got_params, "x": got_x, "context": got_context}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-4, err_msg=jax.tree_util.keystr(path))
    assert np.abs(got_context[1, [2, 4]]).max() == 0.0  # padding gets no gradient


def test_dropout_only_with_a_key():
    config = CrossAttentionConfig(8, 2, d_context=6, dropout=0.3)
    params, x, context = make(config)
    evaluation = apply(params, x, context, config)
    no_dropout = CrossAttentionConfig(8, 2, d_context=6)
    np.testing.assert_array_equal(evaluation, apply(params, x, context, no_dropout))
    train = apply(params, x, context, config, key=jax.random.key(5))
    assert not np.allclose(train, evaluation)
    np.testing.assert_array_equal(train, apply(params, x, context, config, key=jax.random.key(5)))


def test_init_layout_and_config_defaults():
    config = CrossAttentionConfig(12, 4, n_kv_head=2, d_context=7)
    shapes = jax.tree.map(lambda a: a.shape, cross_attention.init(jax.random.key(0), config))
    assert shapes == {
        "q": {"w": (12, 12), "b": (12,)},
        "kv": {"w": (7, 12), "b": (12,)},
        "proj": {"w": (12, 12), "b": (12,)},
    }
    assert CrossAttentionConfig(8, 2) == CrossAttentionConfig(8, 2, n_kv_head=2, d_context=8)
    assert not CrossAttentionConfig(8, 2).attention.causal


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=10, n_head=4), "not divisible by n_head=4"),
        (dict(d_model=8, n_head=2, d_context=0), "d_context must be a positive int"),
        (dict(d_model=8, n_head=4, n_kv_head=3), "n_kv_head=3 must divide n_head=4"),
        (dict(d_model=8, n_head=2, dropout=1.0), "dropout must be in"),
    ],
)
def test_impossible_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CrossAttentionConfig(**kwargs)


def test_wrong_inputs_name_the_argument():
    """Each error names the argument; under the test suite's run-time type checks a wrong shape may be caught
    by jaxtyping (a TypeError naming the parameter) before the layer's own check (a ValueError)."""
    config = CrossAttentionConfig(8, 2, d_context=6)
    params, x, context = make(config)
    with pytest.raises((ValueError, TypeError), match="context"):
        cross_attention.apply(params, x, context[..., :5], config)
    with pytest.raises((ValueError, TypeError), match="x"):
        cross_attention.apply(params, x[..., :6], context, config)
    with pytest.raises((ValueError, TypeError), match="context|batch"):
        cross_attention.apply(params, x, context[:1], config)
    with pytest.raises((ValueError, TypeError), match="kv_mask"):
        cross_attention.apply(params, x, context, config, kv_mask=PADDING[:, :4])
    with pytest.raises(TypeError, match="kv_mask"):
        cross_attention.apply(params, x, context, config, kv_mask=PADDING.astype(np.float32))
    with pytest.raises(ValueError, match=r"params\['kv'\]\['w'\] has shape \(6, 16\), but config .* needs \(6, 8\)"):
        cross_attention.apply(params, x, context, CrossAttentionConfig(8, 2, n_kv_head=1, d_context=6))
    with pytest.raises(KeyError, match=r"cross_attention: params have missing keys \['kv'\]"):
        cross_attention.apply({"q": params["q"], "proj": params["proj"]}, x, context, config)


def test_kv_mask_check_names_the_shapes():
    """The layer's own kv_mask check (reached when the shape check of the type annotations is off)."""
    like = jnp.zeros((B, S, 6))
    with pytest.raises(ValueError, match=r"kv_mask has shape \(2, 4\), expected \(2, 5\) to match context"):
        cross_attention.check_kv_mask("cross_attention", jnp.ones((B, 4), bool), B, S, "context", like)
