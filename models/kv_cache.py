"""The key/value cache the GPT's and the Llama's decoding share (gpt_decode.py, llama_decode.py): every layer's
keys and values for `max_len` positions and, per row, the number of positions written.

    cache = {"k": [n_layer arrays (batch * n_kv_head, max_len, head_dim)], "v": the same, "index": (batch,) int32}

One buffer per layer (a slice of a stacked array is a copy on XLA:CPU), row b's heads at [b * n_kv_head,
(b + 1) * n_kv_head): the layout the attention's matrix products read as it is
(`purejax.nn.attention_cache.cached_attention`), written in place when a decoding step donates the cache.
"""

from typing import Any

import jax
import jax.numpy as jnp

from purejax.nn import check_keys

Cache = dict[str, Any]


def empty(
    n_layer: int, batch: int, n_kv_head: int, max_len: int, head_dim: int, *, dtype: Any, where: str, most: int
) -> Cache:
    """An empty cache, after checking that `batch` is positive and `max_len` in [1, most] (`where` names the
    caller and `most` the model's limit in the error)."""
    for name, value, limit in (("batch", batch, None), ("max_len", max_len, most)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (limit and value > limit):
            bounds = f" in [1, {limit}]" if limit else " >= 1"
            raise ValueError(f"{where}: {name} must be an int{bounds}, got {value!r}")
    shape = (batch * n_kv_head, max_len, head_dim)
    return {
        "k": [jnp.zeros(shape, dtype) for _ in range(n_layer)],
        "v": [jnp.zeros(shape, dtype) for _ in range(n_layer)],
        "index": jnp.zeros((batch,), jnp.int32),
    }


def check(cache: Any, *, batch: int, n_layer: int, n_kv_head: int, head_dim: int, most: int, model: str) -> int:
    """The cache's max_len, after checking its keys, its n_layer buffers' shapes (max_len at most `most`) and
    its index; the errors name what was expected and how to make a cache that fits."""
    check_keys(cache, f"{model} cache", required=("k", "v", "index"))
    for name in ("k", "v"):
        shapes = [tuple(a.shape) for a in cache[name]] if isinstance(cache[name], list | tuple) else None
        max_len = shapes[0][1] if shapes and len(shapes[0]) == 3 and shapes[0][1] <= most else "max_len"
        want = (batch * n_kv_head, max_len, head_dim)
        if shapes is None or len(shapes) != n_layer or any(s != want for s in shapes):
            raise ValueError(
                f"{model}_decode: cache['{name}'] must be a list of n_layer={n_layer} arrays {want} (batch * "
                f"n_kv_head, max_len, head_dim; batch={batch}, max_len <= {most}, n_kv_head={n_kv_head}, head_dim="
                f"{head_dim}), got {shapes or type(cache[name]).__name__}; make it with init_cache(config, batch) "
                f"for this config and batch"
            )
    if tuple(cache["index"].shape) != (batch,) or not jnp.issubdtype(cache["index"].dtype, jnp.integer):
        raise ValueError(
            f"{model}_decode: cache['index'] must be {batch} integers, one per row, got "
            f"{cache['index'].dtype} {tuple(cache['index'].shape)}"
        )
    return shapes[0][1]


def check_room(cache: Cache, seq: int, limit: str) -> None:
    """Eagerly (a concrete index), raise when a row's index + seq passes the cache's max_len (`limit` names
    it, e.g. "block_size" when the two are equal); under jit the row's logits come out NaN instead."""
    index, max_len = cache["index"], cache["k"][0].shape[1]
    if not isinstance(index, jax.core.Tracer) and int(jnp.max(index)) + seq > max_len:
        raise ValueError(
            f"decode_step: a row of the cache holds {int(jnp.max(index))} positions; {seq} more pass {limit}="
            f"{max_len}; make a longer cache with init_cache, up to the model's context"
        )


def overflowed(cache: Cache, seq: int) -> jax.Array:
    """(batch,) whether each row's write of `seq` positions ran past the cache (cached_attention then shifted
    it back into place, over its earlier keys: the caller turns that row's output to NaN, not wrong)."""
    return cache["index"] + seq > cache["k"][0].shape[1]
