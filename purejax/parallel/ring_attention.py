"""Ring attention (Liu et al. 2023): causal self-attention over a sequence split across the devices of a mesh
axis, without any device holding the whole sequence's keys or its score matrix.

Inside `shard_map`, device i holds a block of t queries, keys and values (positions from
`purejax.parallel.context.positions`). The key/value blocks travel around the ring: at step s device i holds
the block of device (i - s) mod n, attends its queries to it, and passes it on to device i+1 with
`jax.lax.ppermute`; after n steps it has seen every block, and the blocks moved n-1 times. The softmax over
all n blocks is computed online (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): each block
gives partial statistics for every query, the row max m, the denominator l = sum exp(s - m) and the
accumulator a = sum exp(s - m) v, and two partial results merge exactly:

    m = max(m1, m2)    l = l1 exp(m1 - m) + l2 exp(m2 - m)    a = a1 exp(m1 - m) + a2 exp(m2 - m)    out = a / l

in float32 whatever the input dtype. No device ever holds more than a (t x t) block of scores.

Causal work per step. Step 0 is the device's own block, under the causal mask by global position. At a later
step, in the zig-zag order (device i holds chunks i and 2n-1-i, each of t/2 tokens), a block from an earlier
device (j < i) is seen whole by both query chunks through its first chunk only, and one from a later device
(j > i) is seen whole, but only by the late query chunk: either way a (t x t/2) product with no mask, the
same on every device (a `lax.cond` picks which). In the contiguous order a block from an earlier device is
seen whole and one from a later device not at all, so devices wait on each other; it is kept to show why.

Backward: autodiff transposes each `ppermute` into one sending the blocks' cotangents back, n-1 more.
Dropout on the attention probabilities is not supported (the ring takes no key): a model with attention
dropout must refuse context parallelism rather than silently train without it.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from purejax.parallel import context

# (m, l, a): running max, denominator and accumulator, (batch, t, n_kv_head, group[, head_dim]) in float32
Stats = tuple[Array, Array, Array]


def ring_attention(
    q: Float[Array, "batch t n_head head_dim"],
    k: Float[Array, "batch t n_kv_head head_dim"],
    v: Float[Array, "batch t n_kv_head head_dim"],
    *,
    axis_name: str,
    zigzag: bool = True,
) -> Float[Array, "batch t n_head head_dim"]:
    """Causal softmax(q k^T / sqrt(head_dim)) v over the whole sequence, for this device's t queries, inside
    `shard_map` over `axis_name` (the module docstring). q head h reads key/value head h // (n_head // n_kv_head).

    Arguments:
        q, k, v: this device's block of the sequence, in the order `context.to_ring_order` gives.
        axis_name: the mesh axis the sequence is split over.
        zigzag: the blocks are in zig-zag order (device i holds chunks i and 2n-1-i); False: contiguous.
    """
    batch, t, n_head, head_dim = q.shape
    if k.shape[:2] != (batch, t) or k.shape != v.shape or n_head % k.shape[2]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be one block of "
            f"the same sequence: (batch, t, heads, head_dim) with k and v alike and n_kv_head dividing n_head"
        )
    n, index = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    q_pos = context.positions(index, n, t, zigzag=zigzag)
    q = q.reshape(batch, t, k.shape[2], n_head // k.shape[2], head_dim) * (1.0 / head_dim**0.5)
    kv = jnp.stack([k, v])  # one transfer per step carries both
    stats = _block(q, kv, q_pos[:, None] >= q_pos[None, :])  # own block, diagonal under the causal mask
    for step in range(1, n):
        kv = jax.lax.ppermute(kv, axis_name, [(j, (j + 1) % n) for j in range(n)])
        earlier = (index - step) % n < index  # this block comes from a device holding earlier positions
        stats = (_zigzag_step if zigzag else _contiguous_step)(stats, q, kv, earlier)
    _, denominator, acc = stats
    return (acc / denominator[..., None]).reshape(batch, t, n_head, head_dim).astype(q.dtype)


def _zigzag_step(stats: Stats, q: Array, kv: Array, earlier: Bool[Array, ""]) -> Stats:
    """A block from an earlier device: all queries see its first (early) chunk. From a later device: the late
    query chunk sees all of it, the early one nothing. Both are (t x t/2), unmasked."""
    half = q.shape[1] // 2

    def early_keys(stats):
        return _merge(stats, _block(q, kv[:, :, :half], None))

    def late_queries(stats):
        late = _merge(tuple(s[:, half:] for s in stats), _block(q[:, half:], kv, None))
        return tuple(jnp.concatenate([s[:, :half], s_late], axis=1) for s, s_late in zip(stats, late))

    return jax.lax.cond(earlier, early_keys, late_queries, stats)


def _contiguous_step(stats: Stats, q: Array, kv: Array, earlier: Bool[Array, ""]) -> Stats:
    """A block from an earlier device is seen whole, one from a later device not at all (this device idles)."""
    return jax.lax.cond(earlier, lambda s: _merge(s, _block(q, kv, None)), lambda s: s, stats)


def _block(
    q: Float[Array, "batch t n_kv_head group head_dim"],
    kv: Float[Array, "2 batch s n_kv_head head_dim"],
    allowed: Bool[Array, "t s"] | None,
) -> Stats:
    """Softmax statistics of (already scaled) queries against one key/value block, True in `allowed` where a
    query may attend (every query row allows at least one key)."""
    logits = jnp.einsum("btkgh,bskh->btkgs", q, kv[0], preferred_element_type=jnp.float32)
    if allowed is not None:
        logits = jnp.where(allowed[None, :, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    p = jnp.exp(logits - m[..., None])
    a = jnp.einsum("btkgs,bskh->btkgh", p.astype(kv.dtype), kv[1], preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1), a


def _merge(x: Stats, y: Stats) -> Stats:
    """Two partial softmaxes over disjoint key sets as one (the module docstring's equations)."""
    m = jnp.maximum(x[0], y[0])
    cx, cy = jnp.exp(x[0] - m), jnp.exp(y[0] - m)
    return m, x[1] * cx + y[1] * cy, x[2] * cx[..., None] + y[2] * cy[..., None]
