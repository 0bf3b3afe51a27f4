"""models.gpt_decode against the full forward pass and nanoGPT's plain generation loop: cached decoding equals
gpt.apply position by position, a batch of prompts of different lengths equals decoding each alone, generation
equals nanoGPT's token for token past block_size, the cache is updated in place (donated, never copied in the
loop), one compilation serves every max_new_tokens and lengths, and its errors."""

import dataclasses
import functools
import re
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt, gpt_decode, gpt_moe
from purejax import sampling
from tests.models.test_gpt import CONFIG, LOOP, B, apply, make_params, tokens

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
    np.testing.assert_array_equal(cache["index"], [8] * B)
    head_dim = config.n_embd // config.n_head
    assert [a.shape for a in cache["k"]] == [(B * config.n_head, config.block_size, head_dim)] * config.n_layer

    # past block_size there is no position left: under jit the output is NaN, not silently wrong; eagerly an error
    logits, _ = decode_step(params, cache, idx[:, :1], config)
    assert np.isnan(logits).all()
    with pytest.raises(ValueError, match="holds 8 positions; 1 more pass block_size=8"):
        gpt_decode.decode_step(params, cache, idx[:, :1], config)


def test_a_mixture_of_experts_decodes_as_its_full_forward_without_a_capacity():
    config = gpt_moe.MoEConfig(**dataclasses.asdict(CONFIG), n_experts=4, capacity_factor=0.5)  # drops in training
    params = gpt.init(jax.random.key(3), config)
    params["blocks"]["moe"]["router"] = jax.tree.map(lambda w: 50.0 * w, params["blocks"]["moe"]["router"])
    idx = tokens((B, 8))
    full = apply(params, idx, gpt_decode.no_capacity(config))
    assert not np.allclose(apply(params, idx, config), full, atol=1e-3)  # the capacity drops tokens in training
    logits, cache = decode_step(params, gpt_decode.init_cache(config, B), idx[:, :3], config)
    np.testing.assert_allclose(logits, full[:, :3], rtol=1e-5, atol=1e-5)
    for t in range(3, 8):
        logits, cache = decode_step(params, cache, idx[:, t : t + 1], config)
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    out = gpt_decode.generate(params, idx[:, :4], config, key=jax.random.key(0), max_new_tokens=6, temperature=0.0)
    assert out.shape == (B, 10)


def test_right_padded_rows_decode_as_each_prompt_alone():
    """decode_step with per-row lengths: each row's logits are gpt.apply's on that row's own tokens, through a
    padded prefill and one-token steps; the padding never shows."""
    params, idx, lengths = make_params(), tokens((3, 8), seed=6), np.array([2, 5, 1])
    padded = np.where(np.arange(5) < lengths[:, None], np.asarray(idx[:, :5]), 0)  # right-padded prompts
    logits, cache = decode_step(params, gpt_decode.init_cache(CONFIG, 3), padded, CONFIG, lengths=lengths)
    np.testing.assert_array_equal(cache["index"], lengths)
    got = [[np.asarray(logits[b, t]) for t in range(lengths[b])] for b in range(3)]
    for step in range(3):  # each row feeds its own next token, at its own position
        next_ids = idx[jnp.arange(3), lengths + step][:, None]
        logits, cache = decode_step(params, cache, next_ids, CONFIG)
        for b in range(3):
            got[b].append(np.asarray(logits[b, 0]))
    for b in range(3):
        n = lengths[b] + 3
        np.testing.assert_allclose(np.stack(got[b]), apply(params, idx[b : b + 1, :n], CONFIG)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "width, lengths, max_new",
    [(5, [2, 5, 1], 3), (6, [3, 6], 6), (10, [10, 4], 3)],
    ids=["within-block", "one-row-outgrows-block", "one-prompt-cropped"],
)
def test_batched_prompts_of_different_lengths_equal_each_prompt_alone(width, lengths, max_new):
    """Greedy generate on a right-padded batch gives each row exactly the ids of generating its prompt alone,
    whether the rows stay in the block, one row outgrows it mid-way (its steps recompute while the other's stay
    cached), or one prompt is longer than the block (cropped, as nanoGPT)."""
    params, key, lengths = make_params(), jax.random.key(3), np.array(lengths)
    ids = tokens((len(lengths), width), seed=7)
    padded = jnp.where(jnp.arange(width) < jnp.asarray(lengths)[:, None], ids, 0)
    out = gpt_decode.generate(params, padded, CONFIG, key=key, max_new_tokens=max_new, temperature=0.0, lengths=lengths)
    chex.assert_shape(out, (len(lengths), width + max_new))
    for b, n in enumerate(lengths):
        alone = gpt_decode.generate(
            params, ids[b : b + 1, :n], CONFIG, key=key, max_new_tokens=max_new, temperature=0.0
        )
        np.testing.assert_array_equal(out[b, : n + max_new], alone[0])
        np.testing.assert_array_equal(out[b, n + max_new :], 0)  # after the row: zeros


# ---------------------------------------------------------------- in place: donation, no copies


def _copies_of_the_cache(hlo: str, cache_elements: int) -> dict[str, int]:
    """Copies and transposes of a cache layer's size (in any layout) in compiled HLO text, per computation (the
    entry computation, outside every loop, is "ENTRY")."""
    counts, computation = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
        match = re.search(r"= \w+\[([\d,]+)\]\S* (copy|transpose)\(", line)
        if match and np.prod([int(d) for d in match.group(1).split(",")]) == cache_elements:
            counts[computation] = counts.get(computation, 0) + 1
    return counts


@pytest.mark.parametrize("batch", [1, 2])
def test_a_donated_cache_is_updated_in_place(batch):
    """Jitted with donate_argnames="cache", a step writes the cache where it lies: every cache array is aliased
    to an output, the compiled step copies none of them, and the caller's buffers are consumed."""
    step = jax.jit(gpt_decode.decode_step, static_argnames="config", donate_argnames="cache")
    params, cache = make_params(), gpt_decode.init_cache(CONFIG, batch)
    hlo = step.lower(params, cache, tokens((batch, 1)), CONFIG).compile().as_text()
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {output}: (parameter, {}, may-alias), ... }
    assert header.count("may-alias") == 2 * CONFIG.n_layer + 1  # k and v of each layer, and the index
    assert _copies_of_the_cache(hlo, cache["k"][0].size) == {}
    old = cache["k"][0]
    _, cache = step(params, cache, tokens((batch, 1)), CONFIG)
    assert old.is_deleted() and not cache["k"][0].is_deleted()


@pytest.mark.parametrize("batch", [1, 2])
def test_the_generation_loop_never_copies_the_cache(batch):
    """Inside generate's token loop no cache-sized array is copied or transposed: the only copies are the empty
    cache's, made once before the loop. (Past the block, the recompute branch is a full forward pass over
    arrays of a cache layer's size, which this count cannot tell apart: not checked.)"""
    max_new = 4
    params, prompt = make_params(), tokens((batch, 3))
    args = (params, prompt, jnp.full((batch,), 3), CONFIG, jax.random.key(0), max_new, 0.0, None, None)
    width = -(-(3 + max_new) // CONFIG.block_size) * CONFIG.block_size
    hlo = gpt_decode._generate.lower(*args, width, CONFIG.block_size).compile().as_text()
    cache_elements = batch * CONFIG.n_head * CONFIG.block_size * (CONFIG.n_embd // CONFIG.n_head)
    copies = _copies_of_the_cache(hlo, cache_elements)
    assert set(copies) <= {"ENTRY"} and copies.get("ENTRY", 0) <= 2 * CONFIG.n_layer, copies


def test_a_cache_of_another_model_is_rejected():
    deeper = dataclasses.replace(CONFIG, n_layer=3)
    with pytest.raises(ValueError, match=r"cache\['k'\] must be a list of n_layer=2 arrays \(8, 8, 8\)"):
        gpt_decode.decode_step(make_params(), gpt_decode.init_cache(deeper, B), tokens((B, 1)), CONFIG)
    with pytest.raises(ValueError, match=r"cache\['index'\] must be 2 integers, one per row"):
        cache = gpt_decode.init_cache(CONFIG, B)
        gpt_decode.decode_step(make_params(), {**cache, "index": cache["index"][:1]}, tokens((B, 1)), CONFIG)
    with pytest.raises(KeyError, match=r"gpt cache: params have missing keys \['index'\]"):
        cache = gpt_decode.init_cache(CONFIG, B)
        gpt_decode.decode_step(make_params(), {"k": cache["k"], "v": cache["v"]}, tokens((B, 1)), CONFIG)


@pytest.mark.parametrize(
    "lengths, message",
    [
        (np.array([3, 6]), r"lengths\[1\]=6 is outside \[1, 5\]"),
        (np.array([0, 2]), r"lengths\[0\]=0 is outside \[1, 5\]"),
    ],
    ids=["longer-than-the-prompt-array", "empty-row"],
)
def test_bad_lengths_are_rejected(lengths, message):
    params, prompt = make_params(), tokens((B, 5))
    with pytest.raises(ValueError, match=message):
        gpt_decode.generate(params, prompt, CONFIG, key=jax.random.key(0), max_new_tokens=2, lengths=lengths)
    with pytest.raises(ValueError, match=message):
        gpt_decode.decode_step(params, gpt_decode.init_cache(CONFIG, B), prompt, CONFIG, lengths=lengths)
    # the shape and dtype (which the test suite's jaxtyping checks catch first, at the public functions)
    with pytest.raises(ValueError, match=r"lengths must be 2 integers, one per row of the prompt, got int\d+ \(3,\)"):
        sampling.check_lengths(jnp.array([2, 2, 2]), prompt, "generate")
    with pytest.raises(ValueError, match="lengths must be 2 integers, one per row of the prompt, got float32"):
        sampling.check_lengths(jnp.array([2.0, 2.0]), prompt, "generate")


def test_a_padded_prompt_beyond_block_size_is_rejected():
    """The padding counts: a cache holding 6 positions has no room for a (padded) chunk of 3, even if each row's
    real tokens would fit."""
    params = make_params()
    _, cache = gpt_decode.decode_step(params, gpt_decode.init_cache(CONFIG, B), tokens((B, 6)), CONFIG)
    with pytest.raises(ValueError, match="holds 6 positions; 3 more pass block_size=8"):
        gpt_decode.decode_step(params, cache, tokens((B, 3)), CONFIG, lengths=np.array([1, 2]))


# ---------------------------------------------------------------- generation


@functools.cache
def naive_step(length):
    """nanoGPT's generation step for one context length: the whole context forward, the last logits sampled."""

    @jax.jit
    def step(params, context, key, temperature, top_p):
        logits = gpt.apply(params, context, CONFIG)[:, -1]
        return sampling.sample(key, logits, temperature=temperature, top_k=5, top_p=top_p)

    return step


def naive_generate(params, prompt, key, max_new_tokens, temperature, top_p, max_len=CONFIG.block_size):
    """nanoGPT's loop, written plainly: crop to the last max_len tokens, run the whole context, sample."""
    idx = prompt
    for i in range(max_new_tokens):
        context = idx[:, -max_len:]
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


def test_generate_with_a_shorter_context_crops_to_its_last_max_len_tokens():
    """max_len=5 < block_size=8: a cache of 5 positions, and nanoGPT's crop at 5 tokens instead of 8."""
    params, prompt, key = make_params(), tokens((B, 4), seed=4), jax.random.key(5)
    out = gpt_decode.generate(params, prompt, CONFIG, key=key, max_new_tokens=5, temperature=0.0, top_k=5, max_len=5)
    np.testing.assert_array_equal(out, naive_generate(params, prompt, key, 5, 0.0, None, max_len=5))
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, block_size=8\], got 9"):
        gpt_decode.generate(params, prompt, CONFIG, key=key, max_new_tokens=1, max_len=9)


def test_generate_compiles_once():
    """Calls that differ in max_new_tokens (within one multiple of block_size), lengths, params values, key,
    temperature and top_p trace and compile the generation loop at most once between them (not at all if an
    earlier test compiled this shape), and the compiled program does not grow with the number of tokens: one
    loop step, not an unrolled loop."""
    params, prompt, keys = make_params(), tokens((B, 7), seed=4), [jax.random.key(i) for i in range(3)]
    params2 = jax.tree.map(lambda a: a * 1.5, params)
    before = gpt_decode._generate._cache_size()
    calls = [
        (params, keys[0], 0.8, 0.9, 5, None),
        (params2, keys[1], 1.3, 0.5, 3, np.array([7, 4])),
        (params, keys[2], 0.0, 0.7, 9, np.array([2, 6])),
    ]
    for p, key, temperature, top_p, max_new, lengths in calls:  # 7 + max_new <= 16 = 2 * block_size: one buffer
        out = gpt_decode.generate(
            p,
            prompt,
            CONFIG,
            key=key,
            max_new_tokens=max_new,
            temperature=temperature,
            top_k=5,
            top_p=top_p,
            lengths=lengths,
        )
        chex.assert_shape(out, (B, 7 + max_new))
    assert gpt_decode._generate._cache_size() - before <= 1

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
