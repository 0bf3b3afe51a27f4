"""Incremental decoding for the GPT of purejax/models/gpt.py: a key/value cache, one decoding step, and
nanoGPT's `generate` built on them.

    cache = init_cache(config, batch)                              # every layer's keys and values, empty
    logits, cache = decode_step(params, cache, prompt, config)     # the prompt in one pass
    logits, cache = decode_step(params, cache, next_ids, config)   # then one token at a time
    tokens = generate(params, prompt, config, key=key, max_new_tokens=50, top_k=200)

Decoding one token at a time should not recompute the whole context. The cache holds every layer's keys and
values for `block_size` positions, stacked like the blocks, and the number of positions written; a decoding
step runs the same blocks as `gpt.apply` (with the same params) on the new tokens alone, their attention
reading and writing the cache (`purejax.nn.attention_cache`). Every shape is fixed, so a step compiles once.
Decoding is inference: no dropout, one device (gather sharded params first).
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray

from purejax import sampling
from purejax.models import gpt
from purejax.models.gpt import GPTConfig, Params
from purejax.nn import attention_cache, check_keys, embedding, layer_norm, mlp, stack

Cache = dict[str, Array]


def init_cache(config: GPTConfig, batch: int, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `block_size` positions, one attention cache per layer stacked on a leading
    n_layer axis: {"k", "v": (n_layer, batch, block_size, n_head, head_dim), "index": (n_layer,) int32}."""
    one = attention_cache.init_cache(config.attention, batch, config.block_size, dtype)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layer, *a.shape)), one)


def decode_step(
    params: Params, cache: Cache, idx: Integer[ArrayLike, "batch seq"], config: GPTConfig
) -> tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for `idx`, the next tokens, at positions [index, index + seq) after the `index` the cache holds,
    and the cache holding them too: token for token what `gpt.apply` gives on the whole sequence. A cache
    written past `block_size` has no learned position left: the logits come out NaN, not silently wrong."""
    h, cache = _hidden(params, cache, idx, config)
    return embedding.attend(params["wte"], h), cache


def _hidden(params: Params, cache: Cache, idx: Any, config: GPTConfig) -> tuple[Array, Cache]:
    """`gpt.hidden` of the new tokens, every layer's attention reading and writing its slice of the cache."""
    idx = jnp.asarray(idx)
    gpt.check_inputs(params, idx, config)
    check_keys(cache, "gpt cache", required=("k", "v", "index"))
    if stack.depth(cache, "cache") != config.n_layer:
        raise ValueError(f"gpt_decode: the cache has {stack.depth(cache, 'cache')} layers, the config "
                         f"{config.n_layer}; make it with init_cache(config, batch)")  # fmt: skip
    positions = cache["index"][0] + jnp.arange(idx.shape[1])  # every layer has written as many positions
    # A position past the table (a cache written beyond block_size) looks up NaNs: wrong output is visible.
    x = embedding.apply(params["wte"], idx) + embedding.apply(params["wpe"], positions)

    def layer(p: Params, x: Array, layer_cache: Cache) -> tuple[Array, Cache]:  # gpt.block, with a cache
        h = layer_norm.apply(p["ln_1"], x)
        a, layer_cache = attention_cache.decode(p["attn"], h, layer_cache, config.attention)
        x = x + a
        return x + mlp.apply(p["mlp"], layer_norm.apply(p["ln_2"], x), activation=config.activation), layer_cache

    if config.layers == "scan":
        x, cache = stack.scan(layer, params["blocks"], x, xs=cache)
    else:
        x, cache = stack.loop(layer, stack.unstack(params["blocks"]), x, xs=cache)
    return layer_norm.apply(params["ln_f"], x), cache


def generate(
    params: Params,
    prompt: Integer[ArrayLike, "batch prompt"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray,
    max_new_tokens: int,
    temperature: float | Float[ArrayLike, ""] = 1.0,
    top_k: int | None = None,
    top_p: float | Float[ArrayLike, ""] | None = None,
) -> Int[Array, "batch total"]:
    """The prompt followed by `max_new_tokens` sampled tokens, int32 (batch, prompt + max_new_tokens).

    Semantics are nanoGPT's `generate`: the model sees at most the last block_size tokens; the next token is
    drawn from softmax(logits / temperature) after top-k and top-p filtering (`purejax.sampling`), and
    temperature 0 takes the arg-max. Step i draws with `fold_in(key, i)`.

    How it runs: the (cropped) prompt fills a key/value cache in one pass, then one `lax.scan` step per new
    token feeds just that token. Once the sequence outgrows block_size, nanoGPT crops it to its last
    block_size tokens and recomputes: every token's position shifts by one, so the cached keys and values
    are stale. The scan does the same, `lax.cond` picking the cached step while the cache has room and the
    full recompute over the last block_size tokens after. Everything is jitted: one compilation per
    (params shapes, prompt shape, config, max_new_tokens, top_k, and whether top_p is None), whatever the
    temperature, top_p, key or number of tokens.
    """
    prompt = jnp.asarray(prompt)
    sampling.check_args(temperature=temperature, top_k=top_k, top_p=top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt.shape[1] == 0:
        raise ValueError("generate: the prompt is empty; give at least one token per row (shape (batch, >= 1))")
    return _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k"))
def _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p) -> Array:
    batch, n_prompt = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.zeros((batch, max_new_tokens), prompt.dtype)], axis=1).astype(jnp.int32)
    if max_new_tokens == 0:
        return tokens
    context = tokens[:, max(0, n_prompt - config.block_size) : n_prompt]  # nanoGPT crops the prompt to the block

    def next_token(logits, i):
        return sampling.sample(jax.random.fold_in(key, i), logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def last_logits(h):
        return embedding.attend(params["wte"], h[:, -1])

    def cached_step(tokens, cache, i):  # feed only token n_prompt + i, at the cache's next position
        h, cache = _hidden(params, cache, jax.lax.dynamic_slice_in_dim(tokens, n_prompt + i, 1, axis=1), config)
        return last_logits(h), cache

    def recompute(tokens, cache, i):  # the sequence outgrew the block: its last block_size tokens, from scratch
        window = jax.lax.dynamic_slice_in_dim(tokens, n_prompt + i + 1 - config.block_size, config.block_size, axis=1)
        return last_logits(gpt.hidden(params, window, config)), cache

    def step(carry, i):  # draw token n_prompt + i, then the logits that follow it
        tokens, logits, cache = carry
        tokens = tokens.at[:, n_prompt + i].set(next_token(logits, i))
        if context.shape[1] + max_new_tokens - 1 > config.block_size:  # static: can the cache run out?
            has_room = cache["index"][0] < config.block_size
            logits, cache = jax.lax.cond(has_room, cached_step, recompute, tokens, cache, i)
        else:
            logits, cache = cached_step(tokens, cache, i)
        return (tokens, logits, cache), None

    h, cache = _hidden(params, init_cache(config, batch, params["wte"]["w"].dtype), context, config)
    carry = (tokens, last_logits(h), cache)
    (tokens, logits, _), _ = jax.lax.scan(step, carry, jnp.arange(max_new_tokens - 1))
    return tokens.at[:, -1].set(next_token(logits, max_new_tokens - 1))
