"""Incremental decoding for `purejax.nn.attention`: a key/value cache and one decoding call.

    cache = init_cache(config, batch, max_len)        # keys and values for max_len positions, index 0
    y, cache = decode(params, x_prompt, cache, config)   # the prompt's tokens at positions [0, prompt)
    y, cache = decode(params, x_next, cache, config)     # then one token at a time

`init_cache` preallocates keys and values for `max_len` positions plus the write index; `decode` writes the
new tokens' keys and values at [index, index + seq), attends over the whole fixed-size cache with a mask that
hides the positions not yet written (and future tokens, when causal), and returns `(y, new_cache)`. Every
shape is static, so decoding token by token under `lax.scan` compiles once, however many tokens are produced.
The same params as `attention.apply`, with the same result for the same tokens (the tests compare them).

Decoding is inference: no dropout, and one device (the heads are not split over a mesh axis).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from purejax import tree as tree_lib
from purejax.nn import attention, linear
from purejax.nn._check import check_keys
from purejax.nn.attention import AttentionConfig, Params

Cache = dict[str, Array]


def init_cache(config: AttentionConfig, batch: int, max_len: int, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `max_len` positions: {"k", "v": (batch, max_len, n_kv_head, head_dim),
    "index": int32 scalar, the number of positions written so far}."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"attention_cache.init_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape = (batch, max_len, config.n_kv_head, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "index": jnp.zeros((), jnp.int32)}


def decode(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    cache: Cache,
    config: AttentionConfig,
    *,
    mask: Bool[Array, "..."] | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Cache]:
    """Self-attention of `x`, the next `seq` tokens, over everything the cache holds and themselves; returns
    `(y, new_cache)`, the cache holding their keys and values too and index + seq.

    Arguments:
        cache: from `init_cache` or a previous call. Writing past max_len cannot be detected at trace time
            (index is traced), so the output is NaN instead of silently wrong.
        mask: True where a query may attend to a key, broadcastable to (batch, n_head or 1, seq, max_len): it
            covers the cache's positions. Combined with the causal mask and the written-positions mask.
    """
    q, k, v = attention.qkv_heads(params, x, config)
    batch, seq, n_head, _ = q.shape
    _check_cache(cache, config, batch, seq)
    index = cache["index"].astype(jnp.int32)
    start = (jnp.zeros((), jnp.int32), index, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start)
    v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)
    new_cache = {"k": k, "v": v, "index": index + seq}
    q_pos, kv_pos = index + jnp.arange(seq), jnp.arange(k.shape[1])
    allowed = attention.combine_masks(mask, config, n_head, q_pos, kv_pos, batch=batch, written=kv_pos < index + seq)
    out = attention.attend(q, k.astype(q.dtype), v.astype(q.dtype), allowed, config)  # a float32 cache, bf16 compute
    y = linear.apply(params["proj"], out.reshape(batch, seq, -1))
    overflow = new_cache["index"] > k.shape[1]
    return jnp.where(overflow, jnp.asarray(jnp.nan, y.dtype), y), new_cache


def _check_cache(cache: Any, config: AttentionConfig, batch: int, seq: int) -> None:
    check_keys(cache, "attention cache", required=("k", "v", "index"))
    max_len = cache["k"].shape[1] if cache["k"].ndim == 4 else None
    want = (batch, max_len, config.n_kv_head, config.head_dim)
    for name in ("k", "v"):
        if cache[name].ndim != 4 or tuple(cache[name].shape) != want:
            raise ValueError(
                f"attention: cache['{name}'] has shape {tuple(cache[name].shape)}, expected (batch={batch}, "
                f"max_len, n_kv_head={config.n_kv_head}, head_dim={config.head_dim}) for x and config {config}; "
                f"make it with attention_cache.init_cache(config, batch, max_len)"
            )
    index = cache["index"]
    if index.shape != () or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"attention: cache['index'] must be an integer scalar, got {tree_lib.describe(index)}")
    if seq > max_len:
        raise ValueError(f"attention: x has seq={seq} tokens, more than the cache's max_len={max_len}")
