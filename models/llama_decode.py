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

from models import llama
from models.llama import LlamaConfig, Params
from purejax import sampling
from purejax.nn import check_keys, embedding, gated_mlp, linear, rms_norm, stack
from purejax.nn.attention_cache import cached_attention

Cache = dict[str, Any]


def init_cache(config: LlamaConfig, batch: int, max_len: int | None = None, *, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `max_len` positions (default config.max_seq_len): {"k", "v": lists of n_layer
    arrays (batch * n_kv_head, max_len, head_dim), row b's heads at [b * n_kv_head, (b + 1) * n_kv_head);
    "index": (batch,) int32, the positions each row has written}."""
    max_len = config.max_seq_len if max_len is None else max_len
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"llama_decode.init_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape, layers = (batch * config.n_kv_head, max_len, config.head_dim), range(config.n_layer)
    return {
        "k": [jnp.zeros(shape, dtype) for _ in layers],
        "v": [jnp.zeros(shape, dtype) for _ in layers],
        "index": jnp.zeros((batch,), jnp.int32),
    }


def decode_step(
    params: Params,
    cache: Cache,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    lengths: Integer[ArrayLike, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for `idx`, the next tokens of each row at positions [index, index + seq), and the cache holding
    them too: token for token what `llama.apply` gives on the whole sequence.

    `lengths` (default: seq for every row) is the number of real tokens in each row of a right-padded `idx`:
    row b's index advances by lengths[b], and the padding's keys are overwritten by the row's next tokens
    before any query can see them (row b's last real logits are `logits[b, lengths[b] - 1]`).

    A row has the cache's max_len positions: index + seq (padding included) past it is an error when the
    cache's index is concrete; under jit (a traced index) that row's logits come out NaN instead, never silently
    wrong, and its cache is spoiled. Jit with `donate_argnames="cache"` to update the cache in place."""
    idx = jnp.asarray(idx)
    llama.check_inputs(params, idx, config)
    _check_cache(cache, config, idx.shape[0])
    lengths = sampling.check_lengths(lengths, idx, "decode_step")
    index, max_len = cache["index"], cache["k"][0].shape[1]
    if not isinstance(index, jax.core.Tracer) and int(jnp.max(index)) + idx.shape[1] > max_len:
        raise ValueError(
            f"decode_step: a row of the cache holds {int(jnp.max(index))} positions; {idx.shape[1]} "
            f"more pass its max_len={max_len}; make a longer cache with init_cache"
        )
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
    overflow = index + seq > cache["k"][0].shape[1]
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


def _check_cache(cache: Any, config: LlamaConfig, batch: int) -> None:
    check_keys(cache, "llama cache", required=("k", "v", "index"))
    for name in ("k", "v"):
        shapes = [tuple(a.shape) for a in cache[name]] if isinstance(cache[name], list | tuple) else None
        max_len = shapes[0][1] if shapes and len(shapes[0]) == 3 else "max_len"
        want = (batch * config.n_kv_head, max_len, config.head_dim)
        if shapes is None or len(shapes) != config.n_layer or any(s != want for s in shapes):
            raise ValueError(
                f"llama_decode: cache['{name}'] must be a list of n_layer={config.n_layer} arrays (batch * "
                f"n_kv_head, max_len, head_dim) = {want} (batch={batch}, n_kv_head={config.n_kv_head}, head_dim="
                f"{config.head_dim}), got {shapes or type(cache[name]).__name__}; make it with "
                f"init_cache(config, batch) for this config and batch"
            )
    if tuple(cache["index"].shape) != (batch,) or not jnp.issubdtype(cache["index"].dtype, jnp.integer):
        raise ValueError(
            f"llama_decode: cache['index'] must be {batch} integers, one per row, got "
            f"{cache['index'].dtype} {tuple(cache['index'].shape)}"
        )
