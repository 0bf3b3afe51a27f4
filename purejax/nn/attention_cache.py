"""Incremental decoding for `purejax.nn.attention`: a key/value cache, one decoding call, and the cached
attention under both (`cached_attention`, which the models' decoders, gpt_decode and llama_decode, call too).

    cache = init_cache(config, batch, max_len)           # keys and values for max_len positions, index 0
    y, cache = decode(params, x_prompt, cache, config)   # the prompt's tokens at positions [0, prompt)
    y, cache = decode(params, x_next, cache, config)     # then one token at a time

A decoding step is bound by memory, not arithmetic: it brings a few new tokens and reads the whole cache. So the
cache is laid out as the attention's matrix products read it, keys and values as (batch * n_kv_head, max_len,
head_dim), row b's heads at [b * n_kv_head, (b + 1) * n_kv_head), and the new tokens' keys and values are
written into it in place when the cache is donated to a jitted step or carried through `lax.scan` /
`lax.fori_loop`: no cache-sized array is copied. Each row has its own index (the positions it has written), so
the rows of a batch may hold sequences of different lengths (the decoders' `lengths=`). The queries attend over
the whole fixed-size cache, a mask hiding the positions not yet written (and future tokens, when causal): every
shape is static, so decoding token by token compiles once, however many tokens are produced. `decode` takes
the same params as `attention.apply` and gives the same result for the same tokens (the tests compare them).

Decoding is inference: no dropout, and one device (the heads are not split over a mesh axis).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from purejax.nn import attention, attention_masks, linear
from purejax.nn._check import check_keys
from purejax.nn.attention import AttentionConfig, Params

Cache = dict[str, Array]


def init_cache(config: AttentionConfig, batch: int, max_len: int, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `max_len` positions: {"k", "v": (batch * n_kv_head, max_len, head_dim),
    "index": (batch,) int32, the number of positions each row has written}."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"attention_cache.init_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape = (batch * config.n_kv_head, max_len, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "index": jnp.zeros((batch,), jnp.int32)}


def decode(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    cache: Cache,
    config: AttentionConfig,
    *,
    mask: Bool[Array, "..."] | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Cache]:
    """Self-attention of `x`, the next `seq` tokens of each row, over everything the cache holds and themselves;
    returns `(y, new_cache)`, the cache holding their keys and values too and each row's index + seq.

    Arguments:
        cache: from `init_cache` or a previous call. Writing past max_len cannot be detected at trace time
            (index is traced), so that row's output is NaN instead of silently wrong.
        mask: True where a query may attend to a key, broadcastable to (batch, n_head or 1, seq, max_len): it
            covers the cache's positions. Combined with the causal mask and the written-positions mask.
    """
    q, k, v = attention.qkv_heads(params, x, config)
    batch, seq, _, _ = q.shape
    _check_cache(cache, config, batch, seq)
    index = cache["index"].astype(jnp.int32)
    out, kv = cached_attention(q, k, v, {"k": cache["k"], "v": cache["v"]}, index, causal=config.causal, mask=mask)
    y = linear.apply(params["proj"], out.reshape(batch, seq, -1))
    overflow = index + seq > cache["k"].shape[1]  # the write was shifted back into place, over earlier keys
    return jnp.where(overflow[:, None, None], jnp.asarray(jnp.nan, y.dtype), y), {**kv, "index": index + seq}


def cached_attention(
    q: Float[Array, "batch seq n_head head_dim"],
    k: Float[Array, "batch seq n_kv_head head_dim"],
    v: Float[Array, "batch seq n_kv_head head_dim"],
    cache: dict[str, Float[Array, "batch*n_kv_head max_len head_dim"]],
    index: Int[Array, " batch"],
    *,
    causal: bool = True,
    mask: Bool[Array, "..."] | None = None,
) -> tuple[Float[Array, "batch seq n_head head_dim"], dict[str, Array]]:
    """Attention of each row's new tokens, at positions index[b], index[b] + 1, ..., over the positions before
    them in the cache and themselves. Their keys and values are written into the cache first, in place (a row
    past max_len overwrites its last slots: the callers turn its output to NaN), then every query reads the
    whole cache, the positions not written yet (or a shorter row's padding) masked out, and when `causal` the
    positions after its own. `mask`: as `decode`'s. Query head j*g+i reads key/value head j. The logits and
    softmax are float32; the cache may be float32 under bfloat16 queries.

    Batch and heads share the products' one batch axis: with a size-1 batch axis of its own, XLA:CPU copied
    the cache at every step of a batch of one."""
    batch, seq, n_head, head_dim = q.shape
    n_kv_head, (max_len, group) = k.shape[2], (cache["k"].shape[1], n_head // k.shape[2])

    def write(cache, new):  # row b's (seq, n_kv_head, head_dim) at its index, in its (n_kv_head, max_len, head_dim)
        def row(c, n, start):
            return jax.lax.dynamic_update_slice(c, jnp.swapaxes(n, 0, 1).astype(c.dtype), (0, start, 0))

        return jax.vmap(row)(cache.reshape(batch, n_kv_head, max_len, head_dim), new, index).reshape(cache.shape)

    cache = {name: write(cache[name], new) for name, new in (("k", k), ("v", v))}
    q = q.reshape(batch, seq, n_kv_head, group, head_dim).transpose(0, 2, 3, 1, 4)  # (b, kv, g, seq, d): small
    logits = jnp.einsum(
        "nqd,nsd->nqs",
        q.reshape(batch * n_kv_head, group * seq, head_dim),
        cache["k"],
        preferred_element_type=jnp.float32,
    ).reshape(batch, n_kv_head, group, seq, max_len)
    allowed = _allowed(index, seq, max_len, causal, mask, n_head, group)
    probs = jax.nn.softmax(jnp.where(allowed, logits * (1.0 / head_dim**0.5), attention_masks.MASKED_LOGIT), axis=-1)
    probs = probs.reshape(batch * n_kv_head, group * seq, max_len).astype(cache["v"].dtype)
    out = jnp.einsum("nqs,nsd->nqd", probs, cache["v"]).reshape(batch, n_kv_head, group, seq, head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, n_head, head_dim).astype(q.dtype), cache


def _allowed(index: Array, seq: int, max_len: int, causal: bool, mask: Array | None, n_head: int, group: int):
    """(batch, n_kv_head|1, group|1, seq, max_len): True where query t of row b may read cache position s."""
    batch, slots = index.shape[0], jnp.arange(max_len)
    if causal:  # up to the query's own position
        allowed = slots <= (index[:, None] + jnp.arange(seq))[:, None, None, :, None]
    else:  # every position written, this call's included
        allowed = slots < (index + seq)[:, None, None, None, None]
    if mask is None:
        return allowed
    mask = attention_masks.check_mask(mask, n_head, batch, seq, max_len)  # (batch|1, n_head|1, seq|1, max_len|1)
    grouped = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], -1, group, *mask.shape[2:])
    return allowed & grouped


def _check_cache(cache: Any, config: AttentionConfig, batch: int, seq: int) -> None:
    check_keys(cache, "attention cache", required=("k", "v", "index"))
    max_len = cache["k"].shape[1] if cache["k"].ndim == 3 else None
    want = (batch * config.n_kv_head, max_len, config.head_dim)
    for name in ("k", "v"):
        if cache[name].ndim != 3 or tuple(cache[name].shape) != want:
            raise ValueError(
                f"attention: cache['{name}'] has shape {tuple(cache[name].shape)}, expected (batch * n_kv_head="
                f"{batch} * {config.n_kv_head}, max_len, head_dim={config.head_dim}) for x and config {config}; "
                f"make it with attention_cache.init_cache(config, batch, max_len)"
            )
    index = cache["index"]
    if index.shape != (batch,) or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(
            f"attention: cache['index'] must be {batch} integers, one per row, got {index.dtype} {tuple(index.shape)}"
        )
    if seq > max_len:
        raise ValueError(f"attention: x has seq={seq} tokens, more than the cache's max_len={max_len}")
