"""Incremental decoding for the GPT of models/gpt.py: a key/value cache, one decoding step, and
nanoGPT's `generate` built on them.

    cache = init_cache(config, batch)                              # every layer's keys and values, empty
    logits, cache = decode_step(params, cache, prompt, config)     # the prompt in one pass
    logits, cache = decode_step(params, cache, next_ids, config)   # then one token at a time
    tokens = generate(params, prompt, config, key=key, max_new_tokens=50, top_k=200)

Decoding one token at a time should not recompute the whole context. The cache holds every layer's keys and
values for `block_size` positions and, per row, the number of positions written; a decoding step runs the
blocks of `gpt.apply` (the same params) on the new tokens alone, their attention writing them into the cache
and reading it (`purejax.nn.attention_cache.cached_attention`). Every shape is fixed, so a step compiles once.

A decoding step is bound by memory, not arithmetic: it multiplies one token per row by every weight and reads
the whole cache, so its floor is the time to stream those bytes (docs/benchmarks.md measures it), and nothing
else should move. Hence the cache's layout: one buffer per layer (a slice of a stacked array is a copy on
XLA:CPU), keys and values as (batch * heads, block_size, head_dim), the layout the attention's matrix products
read as it is, and each step writes its tokens in place (`generate`'s loop carries the cache; jit
`decode_step` with `donate_argnames="cache"`). For the same reason the layers run as a Python loop over
per-layer params whatever `config.layers`. Rows may hold prompts of different lengths (right-padded,
`lengths`): each row has its own positions and masks. Decoding is inference: no dropout, one device (gather
sharded params first), and a mixture of experts without a capacity (`no_capacity`: no token is dropped).
"""

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray

from models import gpt, gpt_moe, kv_cache
from models.gpt import GPTConfig, Params
from purejax import sampling
from purejax.nn import attention, embedding, layer_norm, linear, stack
from purejax.nn.attention_cache import cached_attention

Cache = kv_cache.Cache


def init_cache(config: GPTConfig, batch: int, max_len: int | None = None, *, dtype: Any = jnp.float32) -> Cache:
    """An empty cache (models/kv_cache.py) for `max_len` positions, by default and at most block_size (the
    learned positions): {"k", "v": lists of n_layer arrays (batch * n_head, max_len, head_dim); "index":
    (batch,) int32, the positions each row has written}."""
    max_len = config.block_size if max_len is None else max_len
    shape = dict(n_kv_head=config.attention.n_kv_head, max_len=max_len, head_dim=config.attention.head_dim)
    where = dict(where="gpt_decode.init_cache", most=config.block_size)
    return kv_cache.empty(config.n_layer, batch, **shape, dtype=dtype, **where)


def decode_step(
    params: Params,
    cache: Cache,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    lengths: Integer[ArrayLike, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for `idx`, the next tokens of each row at positions [index, index + seq), and the cache holding
    them too: token for token what `gpt.apply` gives on the whole sequence.

    `lengths` (default: seq for every row) is the number of real tokens in each row of a right-padded `idx`:
    row b's index advances by lengths[b], and the padding's keys are overwritten by the row's next tokens
    before any query can see them (row b's last real logits are `logits[b, lengths[b] - 1]`).

    A row has the cache's max_len positions (block_size by default): index + seq (padding included) past it is
    an error when the cache's index is concrete; under jit (a traced index) that row's logits come out NaN
    instead, never silently wrong, and its cache is spoiled. Jit with `donate_argnames="cache"` to update the
    cache in place."""
    idx = jnp.asarray(idx)
    gpt.check_inputs(params, idx, config)
    max_len = _check_cache(cache, config, idx.shape[0])
    lengths = sampling.check_lengths(lengths, idx, "decode_step")
    kv_cache.check_room(cache, idx.shape[1], "block_size" if max_len == config.block_size else "its max_len")
    h, cache = _hidden(params, stack.unstack(params["blocks"]), cache, idx, lengths, config)
    return embedding.attend(params["wte"], h), cache


def _hidden(params: Params, blocks: list, cache: Cache, idx: Array, lengths: ArrayLike, config: GPTConfig):
    """`gpt.hidden` of the new tokens (each row at its own positions), every layer writing its cache."""
    positions = cache["index"][:, None] + jnp.arange(idx.shape[1])
    # A position past the table (a cache written beyond block_size) looks up NaNs: wrong output is visible.
    x = embedding.apply(params["wte"], idx) + embedding.apply(params["wpe"], positions)
    batch, seq, _ = x.shape
    new = {"k": [], "v": [], "index": cache["index"] + lengths}
    for p, k, v in zip(blocks, cache["k"], cache["v"], strict=True):  # gpt.block, its attention with a cache
        q, k_new, v_new = attention.qkv_heads(p["attn"], layer_norm.apply(p["ln_1"], x), config.attention)
        out, kv = cached_attention(q, k_new, v_new, {"k": k, "v": v}, cache["index"])
        x = x + linear.apply(p["attn"]["proj"], out.reshape(batch, seq, -1))
        x = x + no_capacity(config).feed_forward(p, layer_norm.apply(p["ln_2"], x))
        new["k"].append(kv["k"])
        new["v"].append(kv["v"])
    # A row whose write ran past the cache had it shifted back into place, over its earlier keys: NaN, not wrong.
    overflow = kv_cache.overflowed(cache, seq)
    return jnp.where(overflow[:, None, None], jnp.nan, layer_norm.apply(params["ln_f"], x)), new


def no_capacity(config: GPTConfig) -> GPTConfig:
    """`config` with a mixture of experts' capacity lifted, so that a decoded token is never dropped (a dense
    config unchanged)."""
    return dataclasses.replace(config, capacity_factor=0.0) if gpt_moe.n_experts(config) else config


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
    max_len: int | None = None,
    lengths: Integer[ArrayLike, " batch"] | None = None,
) -> Int[Array, "batch total"]:
    """Each prompt followed by `max_new_tokens` sampled tokens, int32 (batch, prompt + max_new_tokens).

    Semantics are nanoGPT's `generate`: the model sees at most the last max_len tokens (block_size unless
    given: a shorter context makes every step cheaper, as attention reads the whole cache); the next token is
    drawn from softmax(logits / temperature) after top-k and top-p filtering (`purejax.sampling`), and
    temperature 0 takes the arg-max. Step i draws with `fold_in(key, i)`. The signature is llama_decode's.

    Prompts of different lengths: right-pad them into `prompt` and give `lengths` (batch,), the real tokens of
    each row (1 to prompt.shape[1]; default all). Row b of the result is its lengths[b] prompt tokens, its
    max_new_tokens new tokens, then zeros; greedy, each row is what decoding its prompt alone gives.

    How it runs: the (cropped) prompts fill a key/value cache in one pass, then one `lax.fori_loop` step per
    new token feeds just that token, writing the cache in place. Once a row outgrows block_size, nanoGPT crops
    it to its last block_size tokens and recomputes: every token's position shifts by one, so the cached keys
    and values are stale. The loop does the same: every step runs the cached step, and once a row has no room
    left, `lax.cond` adds the full forward over each row's last block_size tokens, taken for the rows without.
    One compilation serves every max_new_tokens (a traced loop count) and `lengths` for which prompt +
    max_new_tokens falls in the same multiple of block_size, and every temperature, top_p, key and params
    value; it depends on the shapes of params and prompt, the config, top_k and whether top_p is None.
    """
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt, lengths = sampling.check_generate(prompt, lengths, max_new_tokens=max_new_tokens, **settings)
    total = prompt.shape[1] + max_new_tokens
    block = config.block_size if max_len is None else max_len
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= config.block_size:
        raise ValueError(f"generate: max_len must be an int in [1, block_size={config.block_size}], got {block!r}")
    if max_new_tokens == 0:
        return jnp.where(jnp.arange(total) < lengths[:, None], prompt, 0).astype(jnp.int32)
    width = -(-total // block) * block  # the token buffer, a multiple of the context
    out = _generate(params, prompt, lengths, config, key, max_new_tokens, temperature, top_k, top_p, width, block)
    return sampling.first_columns(out, total)


@partial(jax.jit, static_argnames=("config", "top_k", "width", "block"))
def _generate(params, prompt, lengths, config, key, max_new_tokens, temperature, top_k, top_p, width, block) -> Array:
    batch, n_prompt = prompt.shape
    rows, ones = jnp.arange(batch), jnp.ones((batch,), jnp.int32)
    blocks = stack.unstack(params["blocks"])  # sliced once: the loop reads each layer's weights where they lie

    def windows(tokens, end, size):  # each row's `size` tokens before column end (cropped at the start)
        return jax.vmap(lambda row, e: jax.lax.dynamic_slice(row, (e - size,), (size,)))(tokens, end)

    def prefill(tokens):  # nanoGPT crops each prompt to its last block_size tokens
        context_len = min(n_prompt, block)
        real = jnp.minimum(lengths, context_len)
        context = windows(tokens, jnp.maximum(lengths, context_len), context_len)
        cache = init_cache(config, batch, block, dtype=params["wte"]["w"].dtype)
        h, cache = _hidden(params, blocks, cache, context, real, config)
        return embedding.attend(params["wte"], h[rows, real - 1]), cache

    def feed(tokens, i, cache):  # the logits that follow each row's token lengths + i
        h, cache = _hidden(params, blocks, cache, tokens[rows, lengths + i][:, None], ones, config)
        logits = embedding.attend(params["wte"], h[:, 0])
        if min(n_prompt, block) + width - n_prompt - 1 <= block:  # static: no row's cache can run out
            return logits, cache
        # A row past the block has NaN logits (no learned position left): its last block_size tokens, from scratch.
        room = cache["index"] <= block

        def recompute():
            window = windows(tokens, lengths + i + 1, block)
            full = embedding.attend(params["wte"], gpt.hidden(params, window, no_capacity(config))[:, -1])
            return jnp.where(room[:, None], logits, full)

        return jax.lax.cond(jnp.all(room), lambda: logits, recompute), cache

    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    return sampling.generate_loop(
        prefill, feed, prompt, lengths, width=width, key=key, max_new_tokens=max_new_tokens, **settings
    )


def _check_cache(cache: Any, config: GPTConfig, batch: int) -> int:
    head = dict(n_kv_head=config.attention.n_kv_head, head_dim=config.attention.head_dim)
    return kv_cache.check(cache, batch=batch, n_layer=config.n_layer, **head, most=config.block_size, model="gpt")
