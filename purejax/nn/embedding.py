"""Token embedding: a lookup table, and its transpose as a tied output head (un-embedding).

params: {"w": (vocab, d_model)}. Tying the LM head to the input embedding (Press & Wolf 2017) is what GPT-2
and nanoGPT do: `attend(params, h)` computes logits h @ w.T with the same table.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from purejax.nn import initializers
from purejax.nn._check import check_dim, check_keys

Params = dict[str, Array]


def init(
    key: PRNGKeyArray,
    vocab_size: int,
    d_model: int,
    *,
    w_init: initializers.Initializer = initializers.normal(1.0),
    dtype: Any = jnp.float32,
) -> Params:
    """A (vocab_size, d_model) table, N(0, 1) by default as torch's nn.Embedding (GPT-2 uses normal(0.02))."""
    if vocab_size <= 0 or d_model <= 0:
        raise ValueError(f"embedding.init: vocab_size and d_model must be positive, got {vocab_size}, {d_model}")
    return {"w": w_init(key, (vocab_size, d_model), dtype)}


def apply(params: Params, ids: Integer[ArrayLike, "*batch"]) -> Float[Array, "*batch d_model"]:
    """Rows of the table for each id. An id outside [0, vocab) gives NaNs (jnp.take's "fill" mode), never a
    silently clamped row. Unsigned ids are fine (token files are often uint16)."""
    check_keys(params, "embedding", required=("w",))
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"embedding: ids must be integers, got {ids.dtype}")
    rows = jnp.take(params["w"], ids, axis=0, mode="fill", fill_value=jnp.nan)
    # jnp.take counts negative ids from the end, as numpy does; an id of -1 is a bug upstream, not the last row.
    return jnp.where((ids < 0)[..., None], jnp.nan, rows)


def attend(params: Params, x: Float[ArrayLike, "*batch d_model"]) -> Float[Array, "*batch vocab"]:
    """Logits against every table row: x @ w.T (the tied LM head)."""
    check_keys(params, "embedding", required=("w",))
    check_dim("embedding.attend", "x", x, -1, params["w"].shape[1], f"params['w'] of shape {tuple(params['w'].shape)}")
    return x @ params["w"].T
