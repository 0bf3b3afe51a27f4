"""Incremental decoding for the Llama of purejax/models/llama.py: a key/value cache, one decoding step, and
`generate` built on them.

    cache = init_cache(config, batch)                              # every layer's keys and values, empty
    logits, cache = decode_step(params, cache, prompt, config)     # the prompt in one pass
    logits, cache = decode_step(params, cache, next_ids, config)   # then one token at a time
    tokens = generate(params, prompt, config, key=key, max_new_tokens=50, top_k=200)

The cache holds every layer's keys and values for `max_len` positions (config.max_seq_len unless given), stacked
like the blocks, and the number of positions written. It is sized by the key/value heads, not the query heads:
grouped-query attention's saving is exactly this memory, n_head / n_kv_head times less than multi-head's (Ainslie
et al. 2023). A decoding step runs the blocks of `llama.apply` (the same params) on the new tokens alone, at
positions index, index + 1, ...: their queries and keys are rotated to those positions (`llama.rotary_qkv`),
their keys and values written at them, and the queries attend over the whole fixed-size cache, the causal mask
hiding what is not written yet. The keys are cached after rotation: rotary makes a key depend on its own position
only, so a cached key never changes as more tokens come. Every shape is fixed, so a step compiles once.
Decoding is inference: one device (gather sharded params first).
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray

from purejax import sampling
from purejax import tree as tree_lib
from purejax.models import llama
from purejax.models.llama import LlamaConfig, Params
from purejax.nn import attention, check_keys, embedding, gated_mlp, linear, rms_norm, stack

Cache = dict[str, Array]


def init_cache(config: LlamaConfig, batch: int, max_len: int | None = None, *, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `max_len` positions (default config.max_seq_len): {"k", "v": (n_layer, batch,
    max_len, n_kv_head, head_dim), "index": int32 scalar, the number of positions written}."""
    max_len = config.max_seq_len if max_len is None else max_len
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"llama_decode.init_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape = (config.n_layer, batch, max_len, config.n_kv_head, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "index": jnp.zeros((), jnp.int32)}


def decode_step(
    params: Params, cache: Cache, idx: Integer[ArrayLike, "batch seq"], config: LlamaConfig
) -> tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for `idx`, the next tokens, at positions [index, index + seq) after the `index` the cache holds,
    and the cache holding them too: token for token what `llama.apply` gives on the whole sequence. Writing past
    the cache's max_len cannot be caught at trace time (index is traced): the logits come out NaN instead."""
    h, cache = _hidden(params, cache, idx, config)
    return llama.unembed(params, h, config), cache


def _hidden(params: Params, cache: Cache, idx: Any, config: LlamaConfig) -> tuple[Array, Cache]:
    """`llama.hidden` of the new tokens, every layer's attention reading and writing its slice of the cache."""
    idx = jnp.asarray(idx)
    llama.check_inputs(params, idx, config)
    _check_cache(cache, config, idx.shape[0])
    index = cache["index"]
    positions = index + jnp.arange(idx.shape[1])

    def layer(p: Params, x: Array, kv: Cache) -> tuple[Array, Cache]:  # llama.block, with a cache
        h = rms_norm.apply(p["attn_norm"], x, eps=config.norm_eps)
        a, kv = _cached_attention(p["attn"], h, kv, positions, config)
        x = x + a
        return x + gated_mlp.apply(p["mlp"], rms_norm.apply(p["mlp_norm"], x, eps=config.norm_eps)), kv

    x, kv = embedding.apply(params["embed"], idx), {"k": cache["k"], "v": cache["v"]}
    if config.layers == "scan":
        x, kv = stack.scan(layer, params["blocks"], x, xs=kv)
    else:
        x, kv = stack.loop(layer, stack.unstack(params["blocks"]), x, xs=kv)
    h = rms_norm.apply(params["norm"], x, eps=config.norm_eps)
    overflow = positions[-1] >= cache["k"].shape[2]  # the write was clamped into place: these logits are wrong
    return jnp.where(overflow, jnp.asarray(jnp.nan, h.dtype), h), {**kv, "index": index + idx.shape[1]}


def _cached_attention(
    params: Params, x: Array, kv: Cache, positions: Array, config: LlamaConfig
) -> tuple[Array, Cache]:
    """`llama.self_attention` of the new tokens over the cache: their rotated keys and values written at
    `positions`, then causal attention over all max_len positions (the unwritten ones lie in the future)."""
    q, k, v = llama.rotary_qkv(params, x, positions, config)
    batch, seq, n_head, _ = q.shape
    start = (0, positions[0], 0, 0)
    k = jax.lax.dynamic_update_slice(kv["k"], k.astype(kv["k"].dtype), start)
    v = jax.lax.dynamic_update_slice(kv["v"], v.astype(kv["v"].dtype), start)
    causal = attention.combine_masks(None, config.attention, n_head, positions, jnp.arange(k.shape[1]), batch=batch)
    out = attention.attend(q, k.astype(q.dtype), v.astype(q.dtype), causal, config.attention)  # a float32 cache
    return linear.apply(params["proj"], out.reshape(batch, seq, -1)), {"k": k, "v": v}


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
) -> Int[Array, "batch total"]:
    """The prompt followed by `max_new_tokens` sampled tokens, int32 (batch, prompt + max_new_tokens).

    The next token is drawn from softmax(logits / temperature) after top-k and top-p filtering
    (`purejax.sampling`, as `gpt_decode.generate`); temperature 0 takes the arg-max. Step i draws with
    `fold_in(key, i)`. The prompt and the new tokens must fit the cache: prompt + max_new_tokens <= max_len
    <= config.max_seq_len (max_len defaults to max_seq_len; a smaller one makes every step cheaper, as attention
    reads the whole cache). Nothing is cropped: the model sees its whole context.

    How it runs: the prompt fills the cache in one pass, then a `lax.fori_loop` feeds one new token per step,
    for a traced number of steps. So one compilation serves every max_new_tokens, temperature, top_p, key and
    params of the same shapes; it depends on the prompt's shape, config, max_len, top_k and whether top_p is
    None. The loop writes into a (batch, max_len) buffer, of which the first prompt + max_new_tokens columns are
    returned.
    """
    prompt = jnp.asarray(prompt)
    sampling.check_args(temperature=temperature, top_k=top_k, top_p=top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: the prompt has shape {tuple(prompt.shape)}; give (batch, >= 1) token ids")
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
        return prompt.astype(jnp.int32)
    tokens = _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p, max_len)
    return tokens[:, :total]


@partial(jax.jit, static_argnames=("config", "top_k", "max_len"))
def _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p, max_len) -> Array:
    batch, n_prompt = prompt.shape
    tokens = jnp.zeros((batch, max_len), jnp.int32).at[:, :n_prompt].set(prompt.astype(jnp.int32))

    def next_token(logits, i):
        return sampling.sample(jax.random.fold_in(key, i), logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def step(i, carry):  # draw token n_prompt + i, then feed it: the logits that follow it
        tokens, logits, cache = carry
        new = next_token(logits, i)
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, n_prompt + i))
        h, cache = _hidden(params, cache, new[:, None], config)
        return tokens, llama.unembed(params, h[:, -1], config), cache

    cache = init_cache(config, batch, max_len, dtype=params["embed"]["w"].dtype)
    h, cache = _hidden(params, cache, prompt, config)
    carry = (tokens, llama.unembed(params, h[:, -1], config), cache)
    tokens, logits, _ = jax.lax.fori_loop(0, max_new_tokens - 1, step, carry)  # a traced count: one compilation
    last = n_prompt + max_new_tokens - 1
    return jax.lax.dynamic_update_slice(tokens, next_token(logits, max_new_tokens - 1)[:, None], (0, last))


def _check_cache(cache: Any, config: LlamaConfig, batch: int) -> None:
    check_keys(cache, "llama cache", required=("k", "v", "index"))
    for name in ("k", "v"):
        shape = tuple(cache[name].shape)
        if len(shape) != 5 or shape[:2] != (config.n_layer, batch) or shape[3:] != (config.n_kv_head, config.head_dim):
            raise ValueError(
                f"llama_decode: cache['{name}'] has shape {shape}, expected (n_layer={config.n_layer}, batch={batch}, "
                f"max_len, n_kv_head={config.n_kv_head}, head_dim={config.head_dim}); make it with "
                f"init_cache(config, batch) for this config and batch"
            )
    index = cache["index"]
    if index.shape != () or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"llama_decode: cache['index'] must be an integer scalar, got {tree_lib.describe(index)}")
