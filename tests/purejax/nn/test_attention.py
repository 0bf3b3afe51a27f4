"""purejax.nn.attention (and attention_cache, its decoding) against an independent numpy float64 multi-head
attention; both formulations, the key/value cache, causality, grouped heads, dropout, bfloat16 and the errors."""

import warnings

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import _attention_impl, attention, attention_cache, initializers
from purejax.nn._attention_impl import Backend
from purejax.nn.attention import AttentionConfig

B, T, D = 2, 6, 16

# jitted once per config: eager dispatch would compile every primitive separately, which is slower in tests
apply = jax.jit(attention.apply, static_argnums=2)
decode = jax.jit(attention_cache.decode, static_argnums=3)
init_cache = attention_cache.init_cache


def make(config, seed=0):
    params = attention.init(jax.random.key(seed), config)
    # non-zero biases, so a bias applied in the wrong place cannot hide
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(seed + 1), a.shape), params)
    x = jax.random.normal(jax.random.key(seed + 2), (B, T, config.d_model))
    return params, x


def np_attention(params, x, config, mask=None):
    """Textbook attention in float64: q/k/v read from the grouped column layout (per key/value head: its
    query heads, its key, its value), key/value heads repeated for grouped queries, -inf for masked logits."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    n, kv, h = config.n_head, config.n_kv_head, config.head_dim
    qkv = x @ p["qkv"]["w"] + p["qkv"].get("b", 0.0)
    g = n // kv
    groups = [qkv[..., j * (g + 2) * h : (j + 1) * (g + 2) * h] for j in range(kv)]
    q = np.concatenate([grp[..., : g * h] for grp in groups], axis=-1).reshape(b, t, n, h)
    k = np.stack([grp[..., g * h : (g + 1) * h] for grp in groups], axis=2)
    v = np.stack([grp[..., (g + 1) * h :] for grp in groups], axis=2)
    k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    allowed = np.ones((t, t), bool)
    if config.causal:
        allowed = np.tril(allowed)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, n * h)
    return out @ p["proj"]["w"] + p["proj"].get("b", 0.0)


CONFIGS = [
    AttentionConfig(D, 4, causal=True),
    AttentionConfig(D, 4, causal=False),
    AttentionConfig(D, 4, n_kv_head=2, causal=True),
    AttentionConfig(D, 2, n_kv_head=1, bias=False, causal=True),  # multi-query
]


@pytest.mark.parametrize("impl", ["fused", "einsum"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_numpy(config, impl):
    config = AttentionConfig(**{**config.__dict__, "impl": impl})
    params, x = make(config)
    y = jax.jit(attention.apply, static_argnums=2)(params, x, config)
    chex.assert_shape(y, (B, T, D))
    np.testing.assert_allclose(y, np_attention(params, x, config), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("impl", ["fused", "einsum"])
def test_padding_and_per_head_masks_match_numpy(impl, causal):
    """A key-padding mask (batch, 1, 1, kv_len) alone (an encoder's) or with the causal one."""
    config = AttentionConfig(D, 4, n_kv_head=2, impl=impl, causal=causal)
    params, x = make(config)
    lengths = np.array([T, 3])
    padding = (np.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (batch, 1, 1, kv_len)
    y = apply(params, x, config, mask=jnp.asarray(padding))
    np.testing.assert_allclose(y, np_attention(params, x, config, padding), rtol=1e-5, atol=1e-5)

    per_head = np.random.default_rng(0).random((B, 4, T, T)) < 0.5
    per_head |= np.eye(T, dtype=bool)  # every query may see itself, so no row is empty
    y = apply(params, x, config, mask=jnp.asarray(per_head))
    np.testing.assert_allclose(y, np_attention(params, x, config, per_head), rtol=1e-5, atol=1e-5)


def test_query_that_sees_nothing_is_finite_and_paths_agree():
    mask = jnp.zeros((1, 1, T, T), bool).at[..., 0, :].set(True)  # only query row 0 may attend
    outs = []
    for impl in ("fused", "einsum"):
        config = AttentionConfig(D, 4, causal=False, impl=impl)
        params, x = make(config)
        outs.append(apply(params, x, config, mask=mask))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_paths_agree_in_value_and_gradient():
    fused, einsum = (
        AttentionConfig(D, 4, n_kv_head=2, impl="fused", causal=True),
        AttentionConfig(D, 4, n_kv_head=2, impl="einsum", causal=True),
    )
    params, x = make(fused)

    def loss(params, x, config):
        return jnp.sum(jnp.sin(apply(params, x, config)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    (v1, g1), (v2, g2) = grad(params, x, fused), grad(params, x, einsum)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    chex.assert_trees_all_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_causality_a_future_token_never_changes_earlier_outputs():
    config = AttentionConfig(D, 4, n_kv_head=2, causal=True)
    params, x = make(config)
    y = apply(params, x, config)
    for t in range(T):
        changed = x.at[:, t].add(5.0)
        y2 = apply(params, changed, config)
        np.testing.assert_array_equal(y2[:, :t], y[:, :t])
        assert not np.allclose(y2[:, t:], y[:, t:])


@pytest.mark.parametrize(
    "config", [AttentionConfig(D, 4, causal=True), AttentionConfig(D, 4, n_kv_head=1, causal=True)], ids=str
)
def test_cached_decoding_equals_full_forward(config):
    params, x = make(config)
    full = apply(params, x, config)
    max_len = T + 3  # longer than needed: the unwritten tail must stay invisible

    # one token at a time, under lax.scan
    def step(cache, x_t):
        y_t, cache = decode(params, x_t[:, None], cache, config)
        return cache, y_t[:, 0]

    cache, ys = jax.lax.scan(step, init_cache(config, B, max_len), jnp.swapaxes(x, 0, 1))
    np.testing.assert_allclose(jnp.swapaxes(ys, 0, 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache["index"], [T] * B)

    # a prompt of 4 tokens, then the rest one by one
    y_prompt, cache = decode(params, x[:, :4], init_cache(config, B, max_len), config)
    np.testing.assert_allclose(y_prompt, full[:, :4], rtol=1e-5, atol=1e-5)
    for t in range(4, T):
        y_t, cache = decode(params, x[:, t : t + 1], cache, config)
        np.testing.assert_allclose(y_t[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_cached_decoding_with_a_padding_mask_over_cache_positions():
    config = AttentionConfig(D, 4, causal=True)
    params, x = make(config)
    padding = jnp.asarray(np.arange(T)[None, :] != 1)[:, None, None, :]  # key position 1 hidden, (1, 1, 1, T)
    full = apply(params, x, config, mask=padding)
    y0, cache = decode(params, x[:, :3], init_cache(config, B, T), config, mask=padding)
    y1, _ = decode(params, x[:, 3:], cache, config, mask=padding)
    np.testing.assert_allclose(jnp.concatenate([y0, y1], axis=1), full, rtol=1e-5, atol=1e-5)


def test_non_causal_decoding_reads_every_written_position():
    """Without the causal mask, the last chunk's queries see every position written (their own chunk's
    included) and nothing unwritten: the full non-causal pass's last positions, from a longer cache."""
    config = AttentionConfig(D, 4, n_kv_head=2, causal=False)
    params, x = make(config)
    _, cache = decode(params, x[:, :3], init_cache(config, B, T + 2), config)
    y, cache = decode(params, x[:, 3:], cache, config)
    np.testing.assert_allclose(y, apply(params, x, config)[:, 3:], rtol=1e-5, atol=1e-5)
    first, _ = decode(params, x[:, :3], init_cache(config, B, T), config)
    assert not np.allclose(first, apply(params, x, config)[:, :3])  # the first chunk did not see the later tokens


def test_decoding_under_scan_traces_once():
    config = AttentionConfig(D, 4, n_kv_head=2, causal=True)
    params, x = make(config)

    @chex.assert_max_traces(n=1)
    def step(cache, x_t):
        y_t, cache = attention_cache.decode(params, x_t[:, None], cache, config)
        return cache, y_t[:, 0]

    @jax.jit
    def decode_all(cache, xs):
        return jax.lax.scan(step, cache, xs)

    xs = jnp.swapaxes(x, 0, 1)
    cache, _ = decode_all(init_cache(config, B, 2 * T), xs)
    cache, ys = decode_all(cache, xs)  # another start index: a traced value, so no retrace
    np.testing.assert_array_equal(cache["index"], [2 * T] * B)
    assert np.isfinite(ys).all()


def test_writing_past_the_cache_gives_nan_not_a_silent_answer():
    config = AttentionConfig(D, 4, causal=True)
    params, x = make(config)
    _, cache = decode(params, x[:, :4], init_cache(config, B, T), config)
    y, _ = decode(params, x[:, :4], cache, config)  # positions 4..7 of a 6-long cache
    assert np.isnan(y).all()


def test_dropout_deterministic_given_a_key_unbiased_and_identity_without():
    """Same key, same output; no key, the evaluation output; and since inverted dropout (on the probabilities
    and on the output) keeps the expectation, the mean over many keys approaches the evaluation output
    (within 5 standard errors). One vmapped compile serves all three: threefry is slow to compile on CPU."""
    config = AttentionConfig(8, 2, dropout=0.2, causal=True)
    params = attention.init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (1, 4, 8))
    keys = jax.random.split(jax.random.key(2), 4000)
    keys = jnp.concatenate([keys, keys[:1]])  # the last key repeats the first
    samples = jax.jit(jax.vmap(lambda k: attention.apply(params, x, config, key=k)))(keys)
    evaluation = apply(params, x, config)
    np.testing.assert_array_equal(evaluation, apply(params, x, AttentionConfig(8, 2, causal=True)))
    np.testing.assert_array_equal(samples[0], samples[-1])
    assert not np.allclose(samples[0], samples[1]) and not np.allclose(samples[0], evaluation)
    samples = samples[:-1]
    stderr = samples.std(0) / np.sqrt(len(samples))
    assert np.all(np.abs(samples.mean(0) - evaluation) < 5 * stderr + 1e-6)


@pytest.mark.parametrize("impl", ["fused", "einsum"])
def test_bfloat16_inputs_use_a_float32_softmax(impl):
    config = AttentionConfig(D, 4, n_kv_head=2, impl=impl, causal=True)
    params, x = make(config)
    params16, x16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
    y16 = apply(params16, x16, config)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), apply(params, x, config), atol=5e-2, rtol=5e-2)
    # the softmax's exponentials are float32 even though everything around them is bfloat16
    jaxpr = jax.make_jaxpr(lambda p, x: apply(p, x, config))(params16, x16)
    exps = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)


def test_bfloat16_computation_reads_a_float32_cache():
    config = AttentionConfig(D, 4, causal=True)
    params, x = make(config)
    params16, x16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
    y, cache = decode(params16, x16, init_cache(config, B, T, jnp.float32), config)
    assert y.dtype == jnp.bfloat16 and cache["k"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float32), apply(params, x, config), atol=5e-2, rtol=5e-2)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_params_layout_and_init_options():
    config = AttentionConfig(D, 4, n_kv_head=2, causal=True)
    params = attention.init(jax.random.key(0), config, proj_init=initializers.zeros())
    chex.assert_shape(params["qkv"]["w"], (D, (4 + 2 * 2) * 4))
    np.testing.assert_array_equal(params["proj"]["w"], 0.0)
    assert "b" not in attention.init(jax.random.key(0), AttentionConfig(D, 4, bias=False, causal=True))["qkv"]


def test_config_is_hashable_and_defaults_kv_heads():
    assert AttentionConfig(D, 4, causal=True) == AttentionConfig(D, 4, n_kv_head=4, causal=True)
    assert hash(AttentionConfig(D, 4, causal=True)) == hash(AttentionConfig(D, 4, n_kv_head=4, causal=True))
    assert AttentionConfig(D, 4, causal=True).head_dim == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=True, d_model=10, n_head=4), "not divisible by n_head=4"),
        (dict(causal=True, d_model=16, n_head=4, n_kv_head=3), "n_kv_head=3 must divide n_head=4"),
        (dict(causal=True, d_model=16, n_head=0), "n_head must be a positive int"),
        (dict(causal=True, d_model=16, n_head=4, dropout=1.0), "dropout must be in"),
        (dict(causal=True, d_model=16, n_head=4, impl="flash"), "impl"),  # a TypeError from beartype in tests
        (dict(causal=True, d_model=16, n_head=4, impl="fused", dropout=0.1), "cannot drop attention probabilities"),
    ],
)
def test_impossible_config(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AttentionConfig(**kwargs)


def test_causal_is_a_required_choice():
    """An encoder that forgets `causal` gets an error naming it, not a causal mask it did not ask for."""
    with pytest.raises(TypeError, match="causal"):
        AttentionConfig(d_model=D, n_head=4)
    assert not AttentionConfig(D, 4, causal=False).causal


def test_wrong_inputs_give_clear_errors():
    config = AttentionConfig(D, 4, causal=True)
    params, x = make(config)
    with pytest.raises(ValueError, match=r"x has shape \(2, 6, 8\), expected \(batch, seq, d_model=16\)"):
        attention.apply(params, x[..., :8], config)
    wrong_heads = r"params\['qkv'\]\['w'\] has shape \(16, 48\), but config .* needs \(16, 32\)"
    with pytest.raises(ValueError, match=wrong_heads):
        attention.apply(params, x, AttentionConfig(D, 4, n_kv_head=2, causal=True))
    with pytest.raises(KeyError, match=r"attention: params have missing keys \['proj'\]"):
        attention.apply({"qkv": params["qkv"]}, x, config)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 6, 5\), which does not broadcast"):
        attention.apply(params, x, config, mask=jnp.ones((B, 1, T, T - 1), bool))
    with pytest.raises(TypeError, match="mask"):  # "mask must be boolean"; beartype's report in tests
        attention.apply(params, x, config, mask=jnp.ones((B, 1, T, T)))


def test_wrong_caches_give_clear_errors():
    config = AttentionConfig(D, 4, causal=True)
    params, x = make(config)
    wrong_heads = r"cache\['k'\] has shape \(4, 8, 4\), expected \(batch \* n_kv_head=2 \* 4, max_len, head_dim=4"
    with pytest.raises(ValueError, match=wrong_heads):
        attention_cache.decode(params, x, init_cache(AttentionConfig(D, 4, n_kv_head=2, causal=True), B, 8), config)
    with pytest.raises(ValueError, match=r"cache\['k'\] has shape \(12, 8, 4\), expected \(batch \* n_kv_head=2"):
        attention_cache.decode(params, x, init_cache(config, 3, 8), config)
    with pytest.raises(ValueError, match="seq=6 tokens, more than the cache's max_len=4"):
        attention_cache.decode(params, x, init_cache(config, B, 4), config)
    with pytest.raises(KeyError, match=r"attention cache: params have missing keys \['index'\]"):
        attention_cache.decode(params, x, {"k": jnp.zeros((B * 4, 8, 4)), "v": jnp.zeros((B * 4, 8, 4))}, config)
    bad_index = {**init_cache(config, B, 8), "index": jnp.zeros((1,), jnp.int32)}
    with pytest.raises(ValueError, match=r"cache\['index'\] must be 2 integers, one per row, got int32 \(1,\)"):
        attention_cache.decode(params, x, bad_index, config)


def test_auto_runs_float16_under_jit():
    """XLA:CPU cannot compile the fused attention in float16; "auto" must fall back to the einsum path."""
    config = AttentionConfig(D, 4, impl="auto", causal=True)
    params, x = make(config)
    params16, x16 = jax.tree.map(lambda a: a.astype(jnp.float16), (params, x))
    y16 = jax.jit(lambda p, x: attention.apply(p, x, config))(params16, x16)
    assert y16.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(y16, np.float32), attention.apply(params, x, config), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "config", [AttentionConfig(D, 4, causal=True), AttentionConfig(D, 4, n_kv_head=2, causal=True)], ids=str
)
def test_qkv_permutation_converts_the_q_k_v_layout(config):
    """Weights in the [all q | all k | all v] layout (nanoGPT, Hugging Face), permuted, give the attention a
    float64 reference computes reading them in that layout; argsort(perm) converts back."""
    params, x = make(config)
    perm = attention.qkv_permutation(config)
    n, kv, h = config.n_head, config.n_kv_head, config.head_dim
    split = jax.tree.map(lambda a: np.asarray(a, np.float64)[..., np.argsort(perm)], params["qkv"])
    qkv = np.asarray(x, np.float64) @ split["w"] + split["b"]
    q = qkv[..., : n * h].reshape(B, T, n, h)
    k = np.repeat(qkv[..., n * h : (n + kv) * h].reshape(B, T, kv, h), n // kv, axis=2)
    v = np.repeat(qkv[..., (n + kv) * h :].reshape(B, T, kv, h), n // kv, axis=2)
    logits = np.where(np.tril(np.ones((T, T), bool)), np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h), -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    out = np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), v).reshape(B, T, n * h)
    expected = out @ np.asarray(params["proj"]["w"], np.float64) + np.asarray(params["proj"]["b"], np.float64)
    np.testing.assert_allclose(apply(params, x, config), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(split["w"][..., perm], params["qkv"]["w"])


# ---------------------------------------------------------------- which implementation runs where (cuDNN on a GPU)

H100, A100, T4 = Backend("gpu", "9.0"), Backend("gpu", "8.0"), Backend("gpu", "7.5")
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize(
    "impl, backend, dtype, head_dim, dropout, masked, how, why",
    [
        ("auto", Backend("cpu"), F32, 64, False, False, "xla", "only on NVIDIA GPUs"),  # the CPU default, unchanged
        ("auto", Backend("cpu"), F16, 64, False, False, "einsum", "XLA:CPU cannot compile"),
        ("auto", Backend("cpu"), BF16, 64, True, False, "einsum", "dropout"),
        ("auto", Backend("tpu"), BF16, 64, False, False, "xla", "'tpu'"),
        ("auto", H100, BF16, 64, False, False, "cudnn", "NVIDIA GPU"),
        ("auto", A100, F16, 128, False, False, "cudnn", "NVIDIA GPU"),
        ("auto", H100, BF16, 256, False, False, "cudnn", "NVIDIA GPU"),  # Hopper takes heads up to 256
        ("auto", A100, BF16, 256, False, False, "xla", "at most 128"),
        ("auto", H100, BF16, 60, False, False, "xla", "multiple of 8"),
        ("auto", H100, F32, 64, False, False, "xla", "float32 inputs"),
        ("auto", T4, BF16, 64, False, False, "xla", "8.0 (Ampere) or newer"),
        ("auto", Backend("gpu"), BF16, 64, False, False, "xla", "not an NVIDIA GPU"),  # e.g. ROCm
        ("auto", H100, BF16, 64, False, True, "xla", "a mask besides the causal one"),
        ("auto", H100, BF16, 64, True, False, "einsum", "dropout"),
        ("fused", H100, BF16, 64, False, False, "xla", "asked for"),
        ("einsum", H100, BF16, 64, False, False, "einsum", "asked for"),
    ],
)
def test_choose_implementation(impl, backend, dtype, head_dim, dropout, masked, how, why):
    got, reason = _attention_impl.choose(impl, backend, dtype, head_dim, dropout=dropout, masked=masked)
    assert got == how and why in reason


@pytest.fixture
def pretend_h100(monkeypatch):
    """`attend` believes it runs on an H100, and every `jax.nn.dot_product_attention` call is recorded and run
    by XLA's implementation (this machine has no cuDNN): the choice and its arguments, checked on a CPU."""
    calls, xla = [], jax.nn.dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append(kwargs)
        return xla(q, k, v, **{**kwargs, "implementation": None})

    monkeypatch.setattr(_attention_impl, "this_backend", lambda: H100)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    _attention_impl.note_fallback.cache_clear()
    yield calls
    _attention_impl.note_fallback.cache_clear()


@pytest.mark.parametrize("causal", [True, False])
def test_auto_on_a_gpu_asks_cudnn_for_its_own_causal_mask(pretend_h100, causal):
    config = AttentionConfig(32, 4, n_kv_head=2, causal=causal)  # head_dim 8, the smallest cuDNN takes
    params, x = jax.tree.map(lambda a: a.astype(BF16), make(config))
    y = attention.apply(params, x, config)
    assert pretend_h100 == [{"is_causal": causal, "implementation": "cudnn"}]  # the mask left to cuDNN
    np.testing.assert_allclose(np.asarray(y, np.float32), np_attention(params, x, config), atol=5e-2, rtol=5e-2)


def test_auto_on_a_gpu_falls_back_to_xla_once_saying_why(pretend_h100):
    config = AttentionConfig(32, 4, causal=True)
    params, x = make(config)
    padding = jnp.arange(T)[None, None, None, :] < jnp.array([T, 3])[:, None, None, None]
    with pytest.warns(UserWarning, match="XLA's attention, not cuDNN's flash attention: float32 inputs"):
        y = attention.apply(params, x, config)
    np.testing.assert_allclose(y, np_attention(params, x, config), rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="a mask besides the causal one"):
        attention.apply(*jax.tree.map(lambda a: a.astype(BF16), (params, x)), config, mask=padding)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second note
        attention.apply(params, x, config)
    assert [call.get("implementation") for call in pretend_h100] == [None, None, None]
    assert pretend_h100[1]["mask"].shape == (B, 1, T, T)  # the padding and causal masks, combined


def _cuda_compute_capability() -> tuple[int, ...]:
    capability = _attention_impl.this_backend().compute_capability
    return tuple(int(part) for part in capability.split(".")) if capability else ()


needs_cudnn = pytest.mark.skipif(
    _cuda_compute_capability() < (8, 0),
    reason="needs an NVIDIA GPU of compute capability 8.0 or newer (cuDNN's flash attention); this backend is "
    f"{jax.default_backend()!r}",
)


def _relative_error(a, b) -> float:
    a, b = (np.asarray(t, np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@needs_cudnn
@pytest.mark.parametrize("n_kv_head", [12, 4])
def test_cudnn_equals_xla_in_value_and_gradient_on_a_gpu(n_kv_head):
    """On a GPU, "auto" in bfloat16 really calls cuDNN (its custom call is in the program) and agrees with XLA's
    fused path ("fused") and a float64 reference, in value and gradient, at GPT-2's head size (12 x 64), plain
    and inside a one-device shard_map (tensor parallelism's code path, check_vma on)."""
    configs = {
        impl: AttentionConfig(768, 12, n_kv_head=n_kv_head, impl=impl, causal=True) for impl in ("auto", "fused")
    }
    params = attention.init(jax.random.key(0), configs["auto"])
    x = jax.random.normal(jax.random.key(1), (4, 256, 768))
    params, x = jax.tree.map(lambda a: a.astype(BF16), (params, x))

    def loss(params, x, config):
        return jnp.mean(jnp.square(attention.apply(params, x, config).astype(F32)))

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
    assert "cudnn" in grad.lower(params, x, configs["auto"]).as_text()
    assert "cudnn" not in grad.lower(params, x, configs["fused"]).as_text()
    (v1, g1), (v2, g2) = grad(params, x, configs["auto"]), grad(params, x, configs["fused"])
    assert _relative_error(v1, v2) < 2e-2
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert _relative_error(a, b) < 3e-2
    y = jax.jit(attention.apply, static_argnums=2)(params, x, configs["auto"])
    assert _relative_error(y, np_attention(params, x, configs["auto"])) < 2e-2

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    spec = jax.sharding.PartitionSpec()
    sharded = jax.shard_map(
        lambda p, x: attention.apply(p, x, configs["auto"], axis_name="model"),
        mesh=mesh,
        in_specs=(spec, spec),
        out_specs=spec,
        check_vma=True,
    )
    assert "cudnn" in jax.jit(sharded).lower(params, x).as_text()
    assert _relative_error(jax.jit(sharded)(params, x), y) < 1e-2
