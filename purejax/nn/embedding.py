"""Token embedding: a lookup table, and its transpose as a tied output head (un-embedding).

params: {"w": (vocab, d_model)}. Tying the LM head to the input embedding (Press & Wolf 2017) is what GPT-2
and nanoGPT do: `attend(params, h)` computes logits h @ w.T with the same table.

Vocab-parallel (Megatron-LM): inside `shard_map`, device i of a mesh axis of size n holds rows
[i * vocab / n, (i + 1) * vocab / n). `apply(..., axis_name=...)` looks up the ids that fall in its rows,
contributes zeros for the others, and `psum`s: every device gets the full embedding. `attend` needs no change:
with a row shard it gives this device's slice of the logits, which `purejax.losses.cross_entropy(...,
axis_name=...)` consumes without ever gathering the whole vocabulary.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from purejax.nn import initializers
from purejax.nn._check import check_dim, check_keys
from purejax.nn._matmul import matmul_rows

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


def apply(
    params: Params, ids: Integer[ArrayLike, "*batch"], *, axis_name: str | None = None
) -> Float[Array, "*batch d_model"]:
    """Rows of the table for each id. An id outside [0, vocab) gives NaNs (jnp.take's "fill" mode), never a
    silently clamped row. Unsigned ids are fine (token files are often uint16). With `axis_name`, the table's
    rows are split over that mesh axis (see the module docstring)."""
    check_keys(params, "embedding", required=("w",))
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"embedding: ids must be integers, got {ids.dtype}")
    if ids.dtype.kind == "u":
        ids = ids.astype(jnp.int32)  # a negative id must stay negative in the checks below
    if axis_name is None:
        rows = jnp.take(params["w"], ids, axis=0, mode="fill", fill_value=jnp.nan)
        # jnp.take counts negative ids from the end, as numpy does; an id of -1 is a bug upstream, not the last row.
        return jnp.where(((ids < 0) | (ids >= params["w"].shape[0]))[..., None], jnp.nan, rows)
    return jax.lax.psum(vocab_shard_rows(params, ids, axis_name=axis_name), axis_name)


def vocab_shard_rows(
    params: Params, ids: Integer[ArrayLike, "*batch"], *, axis_name: str
) -> Float[Array, "*batch d_model"]:
    """This device's part of a vocab-parallel lookup: the rows of the ids that fall in its slice of the table,
    zeros for the others, NaN for ids outside the whole vocabulary. `apply` psums it over `axis_name`; Megatron's
    sequence parallelism reduce-scatters it instead (purejax/parallel/sequence.py)."""
    ids = jnp.asarray(ids)
    ids = ids.astype(jnp.int32) if ids.dtype.kind == "u" else ids  # ids - start below must be able to go negative
    vocab = params["w"].shape[0]
    local = ids - jax.lax.axis_index(axis_name) * vocab
    mine = (local >= 0) & (local < vocab)
    rows = jnp.where(mine[..., None], jnp.take(params["w"], jnp.where(mine, local, 0), axis=0), 0)
    outside = (ids < 0) | (ids >= vocab * jax.lax.axis_size(axis_name))
    return jnp.where(outside[..., None], jnp.nan, rows)


def attend(params: Params, x: Float[ArrayLike, "*batch d_model"]) -> Float[Array, "*batch vocab"]:
    """Logits against every table row: x @ w.T (the tied LM head); with a vocab-parallel shard of the table,
    this device's slice of the logits."""
    x = jnp.asarray(x)
    check_keys(params, "embedding", required=("w",))
    check_dim("embedding.attend", "x", x, -1, params["w"].shape[1], f"params['w'] of shape {tuple(params['w'].shape)}")
    return matmul_rows(x, params["w"].T)  # x @ w.T, as one 2-D product: see _matmul.py for why
