"""models.llama_decode: the cache is sized by the key/value heads, a prefill and then one token at a time
give llama.apply's logits, a batch of prompts of different lengths equals decoding each alone, greedy generation
equals the float64 numpy Llama's, sampled generation equals a loop over the full forward with the same keys, the
cache is updated in place (donated, never copied in the loop), and one compilation serves every number of new
tokens and lengths."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, llama_decode
from models.llama import LlamaConfig
from purejax import sampling
from tests.models import llama_numpy
from tests.models.test_gpt_decode import _copies_of_the_cache

CONFIG = LlamaConfig(
    vocab_size=13, n_layer=2, n_head=4, n_kv_head=2, d_model=16, d_ff=24, max_seq_len=12, rope_theta=500.0
)
IDX = np.random.default_rng(1).integers(0, 13, size=(2, 9))


STEP = jax.jit(llama_decode.decode_step, static_argnames="config")
APPLY = jax.jit(llama.apply, static_argnames="config")


def make_params(config, seed=0):
    return llama.init(jax.random.key(seed), config)


def full_forward_loop(params, prompt, n_new, choose):
    """The prompt and `n_new` tokens, token i = choose(i, logits) from llama.apply's logits of all before it. The
    sequence is padded to its final length, so one compiled forward serves every step (causal: the padding after
    a position does not change its logits)."""
    n_prompt = prompt.shape[1]
    tokens = jnp.zeros((prompt.shape[0], n_prompt + n_new), jnp.int32).at[:, :n_prompt].set(prompt)
    for i in range(n_new):
        logits = APPLY(params, tokens, CONFIG)[:, n_prompt + i - 1]
        tokens = tokens.at[:, n_prompt + i].set(choose(i, logits))
    return tokens


def test_the_cache_is_sized_by_the_key_value_heads():
    for n_kv_head in (4, 2, 1):
        cache = llama_decode.init_cache(dataclasses.replace(CONFIG, n_kv_head=n_kv_head), 3)
        assert [a.shape for a in cache["k"] + cache["v"]] == [(3 * n_kv_head, 12, 4)] * 4  # 2 layers, k and v
        assert cache["index"].shape == (3,) and cache["index"].dtype == jnp.int32
    assert [a.shape for a in llama_decode.init_cache(CONFIG, 1, 5, dtype=jnp.bfloat16)["k"]] == [(2, 5, 4)] * 2


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(n_kv_head=1, tie_embeddings=True, layers="loop")],
    ids=["grouped", "multi-query, tied, loop"],
)
def test_prefill_then_one_token_at_a_time_equals_the_full_forward(changes):
    config = dataclasses.replace(CONFIG, **changes)
    params = make_params(config)
    cache = llama_decode.init_cache(config, 2)
    logits, cache = STEP(params, cache, IDX[:, :4], config)
    pieces = [logits]
    for t in range(4, 9):
        logits, cache = STEP(params, cache, IDX[:, t : t + 1], config)
        pieces.append(logits)
    np.testing.assert_array_equal(cache["index"], [9, 9])
    full = APPLY(params, IDX, config)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full, llama_numpy.forward(params, IDX, config), rtol=1e-4, atol=1e-5)


def test_writing_past_the_cache_gives_nan_not_wrong_logits():
    params = make_params(CONFIG)
    cache = llama_decode.init_cache(CONFIG, 2, 4)
    logits, cache = STEP(params, cache, IDX[:, :4], CONFIG)
    assert np.isfinite(logits).all()
    logits, _ = STEP(params, cache, IDX[:, 4:5], CONFIG)
    assert np.isnan(logits).all()
    with pytest.raises(ValueError, match="holds 4 positions; 1 more pass its max_len=4"):  # eagerly, an error
        llama_decode.decode_step(params, cache, IDX[:, 4:5], CONFIG)


def test_greedy_generation_equals_the_numpy_llama_and_the_full_forward_loop():
    params = make_params(CONFIG, seed=3)
    prompt = IDX[:, :3]
    got = llama_decode.generate(params, prompt, CONFIG, key=jax.random.key(0), max_new_tokens=6, temperature=0.0)
    assert got.shape == (2, 9) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, llama_numpy.greedy(params, prompt, CONFIG, 6))
    np.testing.assert_array_equal(got, full_forward_loop(params, prompt, 6, lambda i, logits: logits.argmax(-1)))


def test_sampled_generation_equals_a_loop_over_the_full_forward():
    """Step i draws with fold_in(key, i) from the filtered logits, as the loop does with llama.apply."""
    params, key, prompt = make_params(CONFIG, seed=5), jax.random.key(7), IDX[:, :2]
    settings = dict(temperature=0.9, top_k=5, top_p=0.8)
    got = llama_decode.generate(params, prompt, CONFIG, key=key, max_new_tokens=7, max_len=10, **settings)
    want = full_forward_loop(
        params, prompt, 7, lambda i, lg: sampling.sample(jax.random.fold_in(key, i), lg, **settings)
    )
    np.testing.assert_array_equal(got, want)


def test_one_compilation_for_any_number_of_new_tokens_and_lengths():
    params, key = make_params(CONFIG), jax.random.key(0)
    before = llama_decode._generate._cache_size()
    outs = [
        llama_decode.generate(params, IDX[:, :3], CONFIG, key=key, max_new_tokens=n, temperature=t, top_p=0.9)
        for n, t in ((1, 0.7), (4, 0.7), (9, 0.7), (4, 1.3))
    ]
    short = llama_decode.generate(
        params, IDX[:, :3], CONFIG, key=key, max_new_tokens=6, top_p=0.9, lengths=np.array([1, 3])
    )
    assert [o.shape for o in outs + [short]] == [(2, 4), (2, 7), (2, 12), (2, 7), (2, 9)]
    assert llama_decode._generate._cache_size() - before <= 1  # 0 if an earlier test compiled this one
    np.testing.assert_array_equal(outs[2][:, :7], outs[1])  # step i draws with fold_in(key, i), whatever the length
    np.testing.assert_array_equal(outs[1][:, :4], outs[0])
    assert llama_decode.generate(params, IDX[:, :3], CONFIG, key=key, max_new_tokens=0).shape == (2, 3)


def test_errors():
    params = make_params(CONFIG)
    with pytest.raises(ValueError, match=r"need 13 positions, but the cache holds max_len=12; generate fewer tokens$"):
        llama_decode.generate(params, IDX[:, :4], CONFIG, key=jax.random.key(0), max_new_tokens=9)
    with pytest.raises(ValueError, match=r"max_len=13 is longer than the model's context, config.max_seq_len=12"):
        llama_decode.generate(params, IDX[:, :4], CONFIG, key=jax.random.key(0), max_new_tokens=1, max_len=13)
    with pytest.raises(ValueError, match="prompt has shape"):
        llama_decode.generate(params, np.zeros((2, 0), np.int32), CONFIG, key=jax.random.key(0), max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        llama_decode.generate(params, IDX[:, :2], CONFIG, key=jax.random.key(0), max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"n_kv_head=2, head_dim=4\), got \[\(8, 12, 4\).*make it with init"):
        llama_decode.decode_step(
            params, llama_decode.init_cache(dataclasses.replace(CONFIG, n_kv_head=4), 2), IDX, CONFIG
        )
    with pytest.raises(ValueError, match=r"cache\['index'\] must be 2 integers, one per row, got int32 \(1,\)"):
        cache = llama_decode.init_cache(CONFIG, 2)
        llama_decode.decode_step(params, {**cache, "index": cache["index"][:1]}, IDX, CONFIG)
    with pytest.raises(ValueError, match=r"lengths\[1\]=5 is outside \[1, 4\]"):
        llama_decode.generate(
            params, IDX[:, :4], CONFIG, key=jax.random.key(0), max_new_tokens=1, lengths=np.array([2, 5])
        )
    with pytest.raises(ValueError, match=r"lengths\[0\]=0 is outside \[1, 4\]"):
        llama_decode.decode_step(
            params, llama_decode.init_cache(CONFIG, 2), IDX[:, :4], CONFIG, lengths=np.array([0, 2])
        )


# ---------------------------------------------------------------- rows of different lengths


def test_right_padded_rows_decode_as_each_prompt_alone():
    """decode_step with per-row lengths: each row's logits are llama.apply's on that row's own tokens (rotary at
    its own positions), through a padded prefill and one-token steps; the padding never shows."""
    params, lengths = make_params(CONFIG, seed=2), np.array([2, 5])
    padded = np.where(np.arange(5) < lengths[:, None], IDX[:, :5], 0)
    logits, cache = STEP(params, llama_decode.init_cache(CONFIG, 2), padded, CONFIG, lengths=lengths)
    np.testing.assert_array_equal(cache["index"], lengths)
    got = [[np.asarray(logits[b, t]) for t in range(lengths[b])] for b in range(2)]
    for step in range(3):  # each row feeds its own next token, at its own position
        logits, cache = STEP(params, cache, IDX[np.arange(2), lengths + step][:, None], CONFIG)
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    for b in range(2):
        n = lengths[b] + 3
        np.testing.assert_allclose(np.stack(got[b]), APPLY(params, IDX[b : b + 1, :n], CONFIG)[0], rtol=1e-5, atol=1e-5)


def test_batched_prompts_of_different_lengths_equal_each_prompt_alone():
    """Greedy generate on a right-padded batch gives each row exactly the ids of generating its prompt alone,
    the new tokens from each row's own end, zeros after."""
    params, key, lengths = make_params(CONFIG, seed=3), jax.random.key(3), np.array([6, 2])
    padded = np.where(np.arange(6) < lengths[:, None], IDX[:, :6], 0)
    out = llama_decode.generate(params, padded, CONFIG, key=key, max_new_tokens=5, temperature=0.0, lengths=lengths)
    chex.assert_shape(out, (2, 11))
    for b, n in enumerate(lengths):
        alone = llama_decode.generate(params, IDX[b : b + 1, :n], CONFIG, key=key, max_new_tokens=5, temperature=0.0)
        np.testing.assert_array_equal(out[b, : n + 5], alone[0])
        np.testing.assert_array_equal(out[b, n + 5 :], 0)
    np.testing.assert_array_equal(out[0], llama_numpy.greedy(params, IDX[:1, :6], CONFIG, 5)[0])


# ---------------------------------------------------------------- in place: donation, no copies


@pytest.mark.parametrize("batch", [1, 2])
def test_a_donated_cache_is_updated_in_place(batch):
    """Jitted with donate_argnames="cache", a step writes the cache where it lies: every cache array is aliased
    to an output, the compiled step copies none of them, and the caller's buffers are consumed."""
    step = jax.jit(llama_decode.decode_step, static_argnames="config", donate_argnames="cache")
    params, cache = make_params(CONFIG), llama_decode.init_cache(CONFIG, batch)
    hlo = step.lower(params, cache, IDX[:batch, :1], CONFIG).compile().as_text()
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {output}: (parameter, {}, may-alias), ... }
    assert header.count("may-alias") == 2 * CONFIG.n_layer + 1  # k and v of each layer, and the index
    assert _copies_of_the_cache(hlo, cache["k"][0].size) == {}
    old = cache["k"][0]
    _, cache = step(params, cache, IDX[:batch, :1], CONFIG)
    assert old.is_deleted() and not cache["k"][0].is_deleted()


def test_the_generation_loop_never_copies_the_cache():
    """Inside generate's token loop no cache-sized array is copied or transposed: the only copies are the empty
    cache's, made once before the loop."""
    params, lengths = make_params(CONFIG), np.array([3, 2])
    args = (params, jnp.asarray(IDX[:, :3]), lengths, CONFIG, jax.random.key(0), 4, 0.0, None, None)
    hlo = llama_decode._generate.lower(*args, CONFIG.max_seq_len).compile().as_text()
    copies = _copies_of_the_cache(hlo, 2 * CONFIG.n_kv_head * CONFIG.max_seq_len * CONFIG.head_dim)
    assert set(copies) <= {"ENTRY"} and copies.get("ENTRY", 0) <= 2 * CONFIG.n_layer, copies
