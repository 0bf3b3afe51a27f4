"""Incremental decoding for the Llama of models/llama.py: a key/value cache, one decoding step, and
`generate` built on them.

    cache = init_cache(config, batch)                              # every layer's keys and values, empty
    logits, cache = decode_step(params, cache, prompt, config)     # the prompt in one pass
    logits, cache = decode_step(params, cache, next_ids, config)   # then one token at a time
    tokens = generate(params, prompt, config, key=key, max_new_tokens=50, top_k=200)

The cache holds every layer's keys and values for `max_len` positions (config.max_seq_len unless given) and, per
row, the number of positions written. It is sized by the key/value heads, not the query heads: grouped-query
attention's saving is exactly this memory, n_head / n_kv_head times less than multi-head's (Ainslie et al.
2023). A decoding step runs the blocks of `llama.apply` (the same params) on the new tokens alone, each row at
its own positions index, index + 1, ...: their queries and keys are rotated to those positions, and their
attention writes the keys and values into the cache and reads it (`purejax.nn.attention_cache.cached_attention`).
The keys are cached after rotation: rotary makes a key depend on its own position only, so a cached key never
changes as more tokens come. Every shape is fixed, so a step compiles once.

Decoding is bound by memory, as gpt_decode's docstring explains, and runs the same way: one cache buffer per
layer in the layout the attention's products read, (batch * n_kv_head, max_len, head_dim), written in place
(`generate`'s loop carries the cache; jit `decode_step` with `donate_argnames="cache"`), the layers a Python
loop over per-layer params whatever `config.layers`. Rows may hold prompts of different lengths (right-padded,
`lengths`). Decoding is inference: one device (gather sharded params first).
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray

from models import kv_cache, llama
from models.llama import LlamaConfig, Params
from purejax import sampling
from purejax.nn import embedding, gated_mlp, linear, rms_norm, stack
from purejax.nn.attention_cache import cached_attention

Cache = kv_cache.Cache


def init_cache(config: LlamaConfig, batch: int, max_len: int | None = None, *, dtype: Any = jnp.float32) -> Cache:
    """An empty cache (models/kv_cache.py) for `max_len` positions, by default and at most config.max_seq_len:
    {"k", "v": lists of n_layer arrays (batch * n_kv_head, max_len, head_dim); "index": (batch,) int32, the
    positions each row has written}."""
    max_len = config.max_seq_len if max_len is None else max_len
    shape = dict(n_kv_head=config.n_kv_head, max_len=max_len, head_dim=config.head_dim)
    where = dict(where="llama_decode.init_cache", most=config.max_seq_len)
    return kv_cache.empty(config.n_layer, batch, **shape, dtype=dtype, **where)


def decode_step(
    params: Params,
    cache: Cache,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    lengths: Integer[ArrayLike, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for `idx`, the next tokens of each row at positions [index, index + seq), and the cache holding
    them too: token for token what `llama.apply` gives on the whole sequence. `lengths` (right-padded rows),
    the cache's bound and donating the cache are as in `gpt_decode.decode_step`."""
    idx = jnp.asarray(idx)
    llama.check_inputs(params, idx, config)
    _check_cache(cache, config, idx.shape[0])
    lengths = sampling.check_lengths(lengths, idx, "decode_step")
    kv_cache.check_room(cache, idx.shape[1], "its max_len")
    h, cache = _hidden(params, stack.unstack(params["blocks"]), cache, idx, lengths, config)
    return llama.unembed(params, h, config), cache


def _hidden(params: Params, blocks: list, cache: Cache, idx: Array, lengths: ArrayLike, config: LlamaConfig):
    """`llama.hidden` of the new tokens (each row at its own positions), every layer writing its cache."""
    index = cache["index"]
    positions = index[:, None] + jnp.arange(idx.shape[1])
    x = embedding.apply(params["embed"], idx)
    batch, seq, _ = x.shape
    new = {"k": [], "v": [], "index": index + lengths}
    for p, k, v in zip(blocks, cache["k"], cache["v"], strict=True):  # llama.block, with a cache
        h = rms_norm.apply(p["attn_norm"], x, eps=config.norm_eps)
        q, k_new, v_new = llama.rotary_qkv(p["attn"], h, positions, config)  # each row at its own positions
        out, kv = cached_attention(q, k_new, v_new, {"k": k, "v": v}, index)
        x = x + linear.apply(p["attn"]["proj"], out.reshape(batch, seq, -1))
        x = x + gated_mlp.apply(p["mlp"], rms_norm.apply(p["mlp_norm"], x, eps=config.norm_eps))
        new["k"].append(kv["k"])
        new["v"].append(kv["v"])
    # A row whose write ran past the cache had it shifted back into place, over its earlier keys: NaN, not wrong.
    overflow = kv_cache.overflowed(cache, seq)
    return jnp.where(overflow[:, None, None], jnp.nan, rms_norm.apply(params["norm"], x, eps=config.norm_eps)), new


def generate(
    params: Params,
    prompt: Integer[ArrayLike, "batch prompt"],
    config: LlamaConfig,
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

    The next token is drawn from softmax(logits / temperature) after top-k and top-p filtering
    (`purejax.sampling`, as `gpt_decode.generate`); temperature 0 takes the arg-max. Step i draws with
    `fold_in(key, i)`. The prompt and the new tokens must fit the cache: prompt + max_new_tokens <= max_len
    <= config.max_seq_len (max_len defaults to max_seq_len; a smaller one makes every step cheaper, as attention
    reads the whole cache). Nothing is cropped: the model sees its whole context.

    Prompts of different lengths: right-pad them into `prompt` and give `lengths` (batch,), the real tokens of
    each row (1 to prompt.shape[1]; default all). Row b of the result is its lengths[b] prompt tokens, its
    max_new_tokens new tokens, then zeros; greedy, each row is what decoding its prompt alone gives.

    How it runs: the prompts fill the cache in one pass, then a `lax.fori_loop` feeds one new token per row per
    step, writing the cache in place, into a (batch, max_len) token buffer. So one compilation serves every
    max_new_tokens and `lengths`, temperature, top_p, key and params of the same shapes; it depends on the
    prompt's shape, config, max_len, top_k and whether top_p is None.
    """
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt, lengths = sampling.check_generate(prompt, lengths, max_new_tokens=max_new_tokens, **settings)
    max_len = config.max_seq_len if max_len is None else max_len
    if max_len > config.max_seq_len:
        raise ValueError(
            f"generate: max_len={max_len} is longer than the model's context, config.max_seq_len="
            f"{config.max_seq_len}; raise that first (with rope_scaling, to stretch a trained model)"
        )
    total = prompt.shape[1] + max_new_tokens
    if total > max_len:
        raise ValueError(
            f"generate: a prompt of {prompt.shape[1]} tokens and max_new_tokens={max_new_tokens} need {total} "
            f"positions, but the cache holds max_len={max_len}; generate fewer tokens"
            + (" or pass a larger max_len" if max_len < config.max_seq_len else "")
        )
    if max_new_tokens == 0:
        return jnp.where(jnp.arange(total) < lengths[:, None], prompt, 0).astype(jnp.int32)
    out = _generate(params, prompt, lengths, config, key, max_new_tokens, temperature, top_k, top_p, max_len)
    return sampling.first_columns(out, total)


@partial(jax.jit, static_argnames=("config", "top_k", "max_len"))
def _generate(params, prompt, lengths, config, key, max_new_tokens, temperature, top_k, top_p, max_len) -> Array:
    rows, ones = jnp.arange(prompt.shape[0]), jnp.ones((prompt.shape[0],), jnp.int32)
    blocks = stack.unstack(params["blocks"])  # sliced once: the loop reads each layer's weights where they lie

    def prefill(tokens):
        cache = init_cache(config, prompt.shape[0], max_len, dtype=params["embed"]["w"].dtype)
        h, cache = _hidden(params, blocks, cache, tokens[:, : prompt.shape[1]], lengths, config)
        return llama.unembed(params, h[rows, lengths - 1], config), cache

    def feed(tokens, i, cache):  # the logits that follow each row's token lengths + i
        h, cache = _hidden(params, blocks, cache, tokens[rows, lengths + i][:, None], ones, config)
        return llama.unembed(params, h[:, 0], config), cache

    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    return sampling.generate_loop(
        prefill, feed, prompt, lengths, width=max_len, key=key, max_new_tokens=max_new_tokens, **settings
    )


def _check_cache(cache: Any, config: LlamaConfig, batch: int) -> int:
    head = dict(n_kv_head=config.n_kv_head, head_dim=config.head_dim)
    return kv_cache.check(cache, batch=batch, n_layer=config.n_layer, **head, most=config.max_seq_len, model="llama")
