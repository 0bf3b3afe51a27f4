"""models.gpt_decode against the full forward pass and nanoGPT's plain generation loop: cached decoding equals
gpt.apply position by position, generation equals nanoGPT's token for token past block_size, it compiles once,
and its errors."""

import dataclasses
import functools
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import sampling
from purejax.models import gpt, gpt_decode
from tests.purejax.models.test_gpt import CONFIG, LOOP, B, apply, make_params, tokens

decode_step = jax.jit(gpt_decode.decode_step, static_argnums=3)


# ---------------------------------------------------------------- the key/value cache


@pytest.mark.parametrize("config", [CONFIG, LOOP], ids=["scan", "loop"])
def test_cached_decoding_equals_the_full_forward(config):
    params, idx = make_params(), tokens((B, 8))
    full = apply(params, idx, config)
    logits, cache = decode_step(params, gpt_decode.init_cache(config, B), idx[:, :3], config)  # the prompt at once
    np.testing.assert_allclose(logits, full[:, :3], rtol=1e-5, atol=1e-5)
    for t in range(3, 8):  # then one token at a time
        logits, cache = decode_step(params, cache, idx[:, t : t + 1], config)
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache["index"], [8] * config.n_layer)
    chex.assert_shape(cache["k"], (config.n_layer, B, config.block_size, config.n_head, config.n_embd // config.n_head))

    # past block_size there is no position left: the output is NaN, not silently wrong
    logits, _ = decode_step(params, cache, idx[:, :1], config)
    assert np.isnan(logits).all()


def test_a_cache_of_another_model_is_rejected():
    deeper = dataclasses.replace(CONFIG, n_layer=3)
    with pytest.raises(ValueError, match="the cache has 3 layers, the config 2"):
        gpt_decode.decode_step(make_params(), gpt_decode.init_cache(deeper, B), tokens((B, 1)), CONFIG)
    with pytest.raises(KeyError, match=r"gpt cache: params have missing keys \['index'\]"):
        cache = gpt_decode.init_cache(CONFIG, B)
        gpt_decode.decode_step(make_params(), {"k": cache["k"], "v": cache["v"]}, tokens((B, 1)), CONFIG)


# ---------------------------------------------------------------- generation


@functools.cache
def naive_step(length):
    """nanoGPT's generation step for one context length: the whole context forward, the last logits sampled."""

    @jax.jit
    def step(params, context, key, temperature, top_p):
        logits = gpt.apply(params, context, CONFIG)[:, -1]
        return sampling.sample(key, logits, temperature=temperature, top_k=5, top_p=top_p)

    return step


def naive_generate(params, prompt, key, max_new_tokens, temperature, top_p):
    """nanoGPT's loop, written plainly: crop to the last block_size tokens, run the whole context, sample."""
    idx = prompt
    for i in range(max_new_tokens):
        context = idx[:, -CONFIG.block_size :]
        next_id = naive_step(context.shape[1])(params, context, jax.random.fold_in(key, i), temperature, top_p)
        idx = jnp.concatenate([idx, next_id[:, None]], axis=1)
    return idx


@pytest.mark.parametrize("prompt_len, max_new", [(7, 5), (11, 4)], ids=["fills-then-slides", "prompt-cropped"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_generate_equals_nanogpts_loop_past_block_size(prompt_len, max_new, temperature):
    """(7, 5): the cache holds the prompt and the first new token, then the sequence outgrows block_size=8
    and every later step recomputes the last 8 tokens. (11, 4): the prompt itself is cropped to its last 8."""
    params, prompt, key = make_params(), tokens((B, prompt_len), seed=4), jax.random.key(5)
    out = gpt_decode.generate(
        params, prompt, CONFIG, key=key, max_new_tokens=max_new, temperature=temperature, top_k=5, top_p=0.9
    )
    chex.assert_shape(out, (B, prompt_len + max_new))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, naive_generate(params, prompt, key, max_new, temperature, 0.9))


def test_generate_compiles_once():
    """Calls that differ in params values, key, temperature and top_p compile at most once between them
    (once in all if an earlier test compiled this shape), and the compiled program does not grow with the
    number of tokens: one scan step, not an unrolled loop."""
    params, prompt, keys = make_params(), tokens((B, 7), seed=4), [jax.random.key(i) for i in range(3)]
    params2 = jax.tree.map(lambda a: a * 1.5, params)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        calls = [(params, keys[0], 0.8, 0.9), (params2, keys[1], 1.3, 0.5), (params, keys[2], 0.0, 0.7)]
        for p, key, temperature, top_p in calls:
            gpt_decode.generate(
                p, prompt, CONFIG, key=key, max_new_tokens=5, temperature=temperature, top_k=5, top_p=top_p
            )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) <= 1

    def program_lines(max_new_tokens):
        fn = jax.jit(partial(gpt_decode.generate, config=CONFIG, max_new_tokens=max_new_tokens, top_k=5))
        return len(fn.lower(params, prompt, key=keys[0], temperature=0.8, top_p=0.9).as_text().splitlines())

    assert program_lines(5) == program_lines(50)


def test_zero_new_tokens_returns_the_prompt():
    prompt = tokens((B, 3)).astype(jnp.uint16)
    out = gpt_decode.generate(make_params(), prompt, CONFIG, key=jax.random.key(0), max_new_tokens=0)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, prompt)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
        (dict(max_new_tokens=2, temperature=-0.5), "temperature must be >= 0"),
        (dict(max_new_tokens=2, top_k=0), "top_k must be a positive int"),
        (dict(max_new_tokens=2, top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpt_decode.generate(make_params(), tokens((B, 3)), CONFIG, key=jax.random.key(0), **kwargs)


def test_generate_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="the prompt is empty"):
        gpt_decode.generate(
            make_params(), jnp.zeros((B, 0), jnp.int32), CONFIG, key=jax.random.key(0), max_new_tokens=2
        )
