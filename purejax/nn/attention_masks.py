"""Which query may attend to which key: the boolean masks of `purejax.nn.attention` and its cache.

A mask is True where a query may attend to a key, shaped (batch|1, n_head|1, seq, kv_len): a user's padding
mask, the causal mask of a decoder, a cache's written positions, or their conjunction (`combine_masks`). Masked
logits are set to `MASKED_LOGIT` before the softmax, in every formulation.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

# What masked logits are set to: jax.nn.dot_product_attention's value, so both formulations agree exactly.
# Finite rather than -inf, so a query that may attend to nothing gets a uniform average, never NaN.
MASKED_LOGIT = -0.7 * float(jnp.finfo(jnp.float32).max)


def combine_masks(
    mask: Array | None,
    config: Any,
    n_head: int,
    q_pos: Int[Array, " seq"],
    kv_pos: Int[Array, " kv_len"],
    *,
    batch: int,
    written: Bool[Array, " kv_len"] | None = None,
) -> Array | None:
    """One boolean (batch|1, n_head|1, seq, kv_len) mask, True where a query at absolute position q_pos may
    attend to the key at kv_pos: the user's `mask`, the causal mask (if `config.causal`; `config` is the layer's
    `AttentionConfig`, of which only `causal` is read), and `written` (a cache's filled positions). None when
    nothing is masked."""
    seq, kv_len = q_pos.shape[0], kv_pos.shape[0]
    allowed = None
    if config.causal:
        allowed = kv_pos[None, :] <= q_pos[:, None]
    if written is not None:
        allowed = written[None, :] if allowed is None else allowed & written[None, :]
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (seq, kv_len))[None, None]
    if mask is not None:
        mask = check_mask(mask, n_head, batch, seq, kv_len)
        allowed = mask if allowed is None else mask & allowed
    return allowed


def check_mask(mask: Array, n_head: int, batch: int, seq: int, kv_len: int) -> Bool[Array, "#batch #n_head seq kv_len"]:
    """The mask as 4-D (batch|1, n_head|1, seq, kv_len), after checking it is boolean and broadcastable to
    (batch, n_head|1, seq, kv_len)."""
    want = (batch, n_head, seq, kv_len)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"attention: mask must be boolean (True = may attend), got {mask.dtype}")
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if mask.ndim > 4 or any(s not in (1, w) for s, w in zip(shape, want)):
        raise ValueError(
            f"attention: mask has shape {tuple(mask.shape)}, which does not broadcast to "
            f"(batch={batch}, n_head={n_head} or 1, seq={seq}, kv_len={kv_len}); "
            f"kv_len is the cache's max_len when decoding with a cache"
        )
    # the query axis as long as the queries: a key-padding mask (batch, 1, 1, kv_len) holds for every query
    return jnp.broadcast_to(mask.reshape(shape), (*shape[:2], seq, kv_len))
