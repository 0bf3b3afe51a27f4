"""purejax.models.llama_decode: the cache is sized by the key/value heads, a prefill and then one token at a time
give llama.apply's logits, greedy generation equals the float64 numpy Llama's, sampled generation equals a
loop over the full forward with the same keys, and one compilation serves every number of new tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import sampling
from purejax.models import llama, llama_decode
from purejax.models.llama import LlamaConfig
from tests.purejax.models import llama_numpy

CONFIG = LlamaConfig(vocab_size=13, n_layer=2, n_head=4, n_kv_head=2, d_model=16, d_ff=24, max_seq_len=12,
                     rope_theta=500.0)  # fmt: skip
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
        assert cache["k"].shape == cache["v"].shape == (2, 3, 12, n_kv_head, 4)
        assert cache["index"].shape == () and cache["index"].dtype == jnp.int32
    assert llama_decode.init_cache(CONFIG, 1, 5, dtype=jnp.bfloat16)["k"].shape == (2, 1, 5, 2, 4)


@pytest.mark.parametrize("changes", [dict(), dict(n_kv_head=1, tie_embeddings=True, layers="loop")],
                         ids=["grouped", "multi-query, tied, loop"])  # fmt: skip
def test_prefill_then_one_token_at_a_time_equals_the_full_forward(changes):
    config = dataclasses.replace(CONFIG, **changes)
    params = make_params(config)
    cache = llama_decode.init_cache(config, 2)
    logits, cache = STEP(params, cache, IDX[:, :4], config)
    pieces = [logits]
    for t in range(4, 9):
        logits, cache = STEP(params, cache, IDX[:, t : t + 1], config)
        pieces.append(logits)
    assert int(cache["index"]) == 9
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


def test_one_compilation_for_any_number_of_new_tokens():
    params, key = make_params(CONFIG), jax.random.key(0)
    before = llama_decode._generate._cache_size()
    outs = [
        llama_decode.generate(params, IDX[:, :3], CONFIG, key=key, max_new_tokens=n, temperature=t, top_p=0.9)
        for n, t in ((1, 0.7), (4, 0.7), (9, 0.7), (4, 1.3))
    ]
    assert [o.shape for o in outs] == [(2, 4), (2, 7), (2, 12), (2, 7)]
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
    with pytest.raises(ValueError, match=r"n_kv_head=2, head_dim=4\); make it with init_cache"):
        llama_decode.decode_step(
            params, llama_decode.init_cache(dataclasses.replace(CONFIG, n_kv_head=4), 2), IDX, CONFIG
        )
