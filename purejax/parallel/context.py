"""Where each token lives under context parallelism: the sequence split over the devices of a mesh axis.

Ring attention (purejax/parallel/ring_attention.py) gives every device a block of the sequence. Split
contiguously, device i holds positions [i*t, (i+1)*t); under a causal mask device 0's queries see only its
own block and device n-1's see everything, so with fully masked blocks skipped device 0 idles n-1 steps of
the ring while device n-1 works through all n. The zig-zag order (Llama 3's context parallelism, Dubey et al.
2024, and Zhu's ring-flash-attention; Striped Attention, Brandon et al. 2023, strides instead) balances it: the
sequence is cut into 2n chunks and device i holds chunk i and chunk 2n-1-i, one early and one late, so every
device has the same amount of unmasked work at every step.

    n = 4, sequence of 8 chunks:   device 0: [c0 c7]   device 1: [c1 c6]   device 2: [c2 c5]   device 3: [c3 c4]

`to_ring_order` reorders (and pads) a whole batch so that splitting it contiguously over the axis gives each
device its chunks; `from_ring_order` undoes it; `positions` is what a device computes inside `shard_map` to
know the global positions of its tokens (for the causal mask, and for the position embedding of a GPT).

Padding: a sequence whose length is not a multiple of 2n (zig-zag) or n (contiguous) is padded at its end.
Under a causal mask a padded key sits after every real query, so no real output changes; the padded
queries' outputs are dropped by `from_ring_order` (and a padded target should be ignored, e.g. -1).
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


def positions(
    index: int | Int[Array, ""], n: int, local_len: int, *, zigzag: bool
) -> Int[Array | np.ndarray, " local_len"]:
    """The global positions of the `local_len` tokens device `index` (of `n`) holds, in the order it holds
    them; `index` may be `jax.lax.axis_index(...)` inside `shard_map` (a Python int gives a numpy array)."""
    xp = np if isinstance(index, (int, np.integer)) else jnp
    if zigzag:
        if local_len % 2:
            raise ValueError(
                f"positions: the zig-zag order gives each device two equal chunks, but it holds {local_len} "
                f"tokens (odd); pad the sequence to a multiple of 2 * {n} with to_ring_order"
            )
        chunk = local_len // 2
        early, late = index * chunk, (2 * n - 1 - index) * chunk
        return xp.concatenate([early + np.arange(chunk), late + np.arange(chunk)])
    return index * local_len + xp.arange(local_len)


def padded_length(length: int, n: int, *, zigzag: bool) -> int:
    """The sequence length after padding: the next multiple of 2n (zig-zag) or n (contiguous)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"padded_length: n must be a positive int (the size of the context axis), got {n!r}")
    multiple = 2 * n if zigzag else n
    return -(-length // multiple) * multiple


def ring_order(length: int, n: int, *, zigzag: bool) -> np.ndarray:
    """Global positions of the padded sequence in the order the devices hold them (device 0's first)."""
    local_len = padded_length(length, n, zigzag=zigzag) // n
    return np.concatenate([positions(i, n, local_len, zigzag=zigzag) for i in range(n)])


def to_ring_order(x: Array, n: int, *, zigzag: bool, axis: int = 1, fill: int | float = 0) -> Array:
    """`x` padded with `fill` along `axis` (the sequence) to `padded_length` and reordered so that a
    contiguous split over `n` devices hands each its chunks (e.g. `P(None, "context")` for axis 1)."""
    length = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padded_length(length, n, zigzag=zigzag) - length)
    return jnp.take(jnp.pad(x, pad, constant_values=fill), ring_order(length, n, zigzag=zigzag), axis=axis)


def from_ring_order(y: Array, n: int, length: int, *, zigzag: bool, axis: int = 1) -> Array:
    """The inverse of `to_ring_order`: `y` (in ring order, padded) back in sequence order, cut to `length`."""
    order = ring_order(length, n, zigzag=zigzag)
    if y.shape[axis] != order.size:
        raise ValueError(
            f"from_ring_order: axis {axis} of y has {y.shape[axis]} entries, but a length-{length} sequence over "
            f"{n} devices ({'zig-zag' if zigzag else 'contiguous'}) is padded to {order.size}"
        )
    return jnp.take(y, np.argsort(order)[:length], axis=axis)
