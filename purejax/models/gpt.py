"""GPT (Radford et al. 2019), the model of nanoGPT's model.py, as pure functions over a dict of arrays.

    idx (batch, seq) int
      -> wte[idx] + wpe[positions] -> dropout                        x (batch, seq, n_embd)
      -> n_layer blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x))   x (batch, seq, n_embd)
      -> ln_f -> x @ wte.T                                           logits (batch, seq, vocab_size)

params: {"wte": embedding (vocab_size, n_embd), "wpe": embedding (block_size, n_embd),
         "blocks": {"ln_1", "attn": {"qkv", "proj"}, "ln_2", "mlp": {"fc", "proj"}, every leaf stacked on a
                    leading n_layer axis}, "ln_f"}.
There is no "lm_head": the output head is the token embedding transposed (weight tying, Press & Wolf 2017).

The blocks run under `lax.scan` (one traced block whatever the depth) or, with `layers="loop"`, as a Python
loop; both compute the same thing. Dropout is on when `apply` gets a key. `generate` decodes with a key/value
cache under one `lax.scan`, so producing any number of tokens compiles once.

Several devices. `apply`, `hidden` and `loss` take `axes` (a `purejax.parallel.MeshAxes`; None is one device)
and then run inside `jax.shard_map` on this device's shards, issuing their own collectives: the batch split
over `axes.data` (the loss averaged over it); heads, MLP units and vocabulary split over `axes.model`
(Megatron-LM: attention and mlp psum their row-parallel outputs, the embedding and the cross-entropy are
vocab-parallel, so the logits are never gathered); with `axes.fsdp`, params also split over `axes.data` and
all-gathered before use, one block at a time inside the scan. `SHARDING_RULES` and `param_specs` say who holds
what; docs/parallelism.md draws it.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray

from purejax import losses, parallel, sampling
from purejax import random as prandom
from purejax import tree as tree_lib
from purejax.nn import activations, attention, dropout, embedding, initializers, layer_norm, mlp, stack
from purejax.nn import check_keys
from purejax.parallel import MODEL, MeshAxes

Params = dict[str, Any]
Cache = dict[str, Array]


@dataclass(frozen=True)
class GPTConfig:
    """Static description of a GPT; frozen and hashable, so it can be a static argument to jax.jit.

    Arguments:
        block_size: the longest context, and the number of learned positions.
        vocab_size: number of token ids (GPT-2's 50257 padded to 50304 is nanoGPT's default: a multiple of 64).
        n_layer, n_head, n_embd: depth, attention heads and width; n_head must divide n_embd.
        dropout: rate after the embeddings, on attention probabilities and after each residual branch,
            applied only when `apply` gets a key.
        bias: biases in linear layers and LayerNorms, as GPT-2; False is nanoGPT's "a bit better and faster".
        gelu: "exact" (erf, torch's nn.GELU default, nanoGPT) or "tanh" (the approximation GPT-2 was trained with).
        layers: "scan" (compile time flat in depth) or "loop" (unrolled, which XLA may fuse across layers);
            the same maths, equal to float32 rounding (XLA fuses the two programs differently).
        attention_impl: passed to `purejax.nn.attention` ("auto", "fused" or "einsum").
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    gelu: Literal["exact", "tanh"] = "exact"
    layers: Literal["scan", "loop"] = "scan"
    attention_impl: attention.Impl = "auto"

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"each head gets n_embd // n_head features, so pick n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if self.gelu not in ("exact", "tanh"):
            raise ValueError(f"GPTConfig: gelu must be 'exact' or 'tanh', got {self.gelu!r}")
        if self.layers not in ("scan", "loop"):
            raise ValueError(f"GPTConfig: layers must be 'scan' or 'loop', got {self.layers!r}")
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (impl, dropout) surface here

    @property
    def attention(self) -> attention.AttentionConfig:
        return attention.AttentionConfig(
            d_model=self.n_embd, n_head=self.n_head, bias=self.bias, causal=True,
            dropout=self.dropout, impl=self.attention_impl,
        )  # fmt: skip


def init(key: PRNGKeyArray, config: GPTConfig) -> Params:
    """nanoGPT's initialisation: every linear weight and embedding N(0, 0.02^2), biases zero, LayerNorms the
    identity, and the two projections that write into the residual stream (attn.proj, mlp.proj) at
    std 0.02 / sqrt(2 * n_layer), so the stream's variance does not grow with depth (GPT-2 paper, sec. 2.3)."""
    keys = prandom.named_keys(key, "wte", "wpe", "blocks")
    normal = initializers.normal(0.02)
    residual = initializers.normal(0.02 / math.sqrt(2 * config.n_layer))
    d = config.n_embd

    def block_init(key):
        keys = prandom.named_keys(key, "attn", "mlp")
        return {
            "ln_1": layer_norm.init(None, d, bias=config.bias),
            "attn": attention.init(keys["attn"], config.attention, w_init=normal, proj_init=residual),
            "ln_2": layer_norm.init(None, d, bias=config.bias),
            "mlp": mlp.init(keys["mlp"], d, 4 * d, bias=config.bias, w_init=normal, proj_init=residual),
        }

    return {
        "wte": embedding.init(keys["wte"], config.vocab_size, d, w_init=normal),
        "wpe": embedding.init(keys["wpe"], config.block_size, d, w_init=normal),
        "blocks": stack.init(keys["blocks"], config.n_layer, block_init),
        "ln_f": layer_norm.init(None, d, bias=config.bias),
    }


# ---------------------------------------------------------------- who holds what on a mesh

# Megatron-LM's layout (Shoeybi et al. 2019), rows read top down, first match wins. MODEL is the role of the
# tensor-parallel axis (None when it is off). Leaves under "blocks" have a leading layer axis, never split.
SHARDING_RULES: tuple[tuple[str, P], ...] = (
    (r"wte\.w", P(MODEL, None)),  # vocab-parallel embedding and tied head: rows split
    (r"blocks\.attn\.qkv\.w", P(None, None, MODEL)),  # column-parallel: whole groups of heads per device
    (r"blocks\.attn\.qkv\.b", P(None, MODEL)),
    (r"blocks\.attn\.proj\.w", P(None, MODEL, None)),  # row-parallel: psum, then the replicated bias
    (r"blocks\.mlp\.fc\.w", P(None, None, MODEL)),  # column-parallel
    (r"blocks\.mlp\.fc\.b", P(None, MODEL)),
    (r"blocks\.mlp\.proj\.w", P(None, MODEL, None)),  # row-parallel
    (r".*", P()),  # wpe, LayerNorms, the row-parallel biases: replicated
)


@functools.cache
def _shapes(config: GPTConfig) -> Params:
    """The params' global shapes (ShapeDtypeStructs), traced once per config."""
    return jax.eval_shape(partial(init, config=config), jax.random.key(0))


def param_specs(config: GPTConfig, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> Params:
    """A PartitionSpec for every param of a GPT with `config` run under `axes` on a mesh with these axis sizes
    (`mesh.shape`): `SHARDING_RULES`, plus the data axis on every matrix with `axes.fsdp`
    (`purejax.parallel.fsdp_specs`). Raises if a split would be uneven, naming the size to change."""
    tp = axis_sizes[axes.model] if axes.model is not None else 1
    for name, value in (("n_head", config.n_head), ("vocab_size", config.vocab_size)):
        if value % tp:
            hint = " (the training program pads it up to a multiple of tp)" if name == "vocab_size" else ""
            raise ValueError(
                f"gpt: {name}={value} cannot be split over the {tp} devices of tensor-parallel axis "
                f"{axes.model!r}; tensor parallelism needs {name} divisible by {tp}{hint}"
            )
    shapes = _shapes(config)
    specs = parallel.specs_from_rules(shapes, SHARDING_RULES, {MODEL: axes.model})
    if axes.fsdp:
        specs = parallel.fsdp_specs(shapes, specs, axes.data, axis_sizes[axes.data], stacked=("blocks",))
    parallel.check_divisible(shapes, specs, axis_sizes)
    return specs


def _specs_inside(config: GPTConfig, axes: MeshAxes) -> Params:
    """`param_specs` from inside `shard_map`, where the axis sizes are known to `jax.lax.axis_size`."""
    sizes = {name: jax.lax.axis_size(name) for name in (axes.data, axes.model) if name is not None}
    return param_specs(config, axes, sizes)


# ---------------------------------------------------------------- the model


def block(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: GPTConfig,
    key: PRNGKeyArray | None = None,
    cache: Cache | None = None,
    axes: MeshAxes = MeshAxes(),
) -> tuple[Float[Array, "batch seq d_model"], Cache | None]:
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Returns the new x and
    this layer's new cache (None without one). Under tensor parallelism x is replicated over `axes.model`;
    attention and mlp each end with one psum over it."""
    keys = prandom.named_keys(key, "attn", "mlp") if key is not None else {"attn": None, "mlp": None}
    h = layer_norm.apply(params["ln_1"], x)
    if cache is None:
        x = x + attention.apply(params["attn"], h, config.attention, key=keys["attn"], axis_name=axes.model)
    else:
        a, cache = attention.apply(params["attn"], h, config.attention, cache=cache, key=keys["attn"])
        x = x + a
    gelu = activations.gelu if config.gelu == "exact" else activations.gelu_tanh
    h = layer_norm.apply(params["ln_2"], x)
    x = x + mlp.apply(
        params["mlp"], h, activation=gelu, dropout_rate=config.dropout, key=keys["mlp"], axis_name=axes.model
    )
    return x, cache


def hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    cache: Cache | None = None,
    axes: MeshAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Cache | None]:
    """Token ids to the final LayerNorm's output (the input of the tied head), and the new cache.

    With a cache, the tokens sit at positions [index, index + seq), index being how many it already holds.
    With `axes`, inside `shard_map`: this device's shards of the params and of the batch (see the module
    docstring); the output is replicated over `axes.model`."""
    params, specs, axes = _prepare(params, idx, config, cache, axes)
    return _hidden(params, specs, idx, config, key, cache, axes)


def _prepare(params: Params, idx: Any, config: GPTConfig, cache: Cache | None, axes: MeshAxes | None) -> tuple:
    """Checks the inputs; with data parallelism, casts the replicated params to varying over the data axis
    (whose transpose sums their gradients); with FSDP, all-gathers the split params used once per pass
    (wte, wpe; the vectors, ln_f among them, are never split) and leaves the blocks to be gathered one at a time inside the scan. Returns (params, their specs or
    None, axes)."""
    axes = MeshAxes() if axes is None else axes
    sharded = axes != MeshAxes()
    if sharded and cache is not None:
        raise ValueError(f"gpt: decoding with a cache runs on one device; got axes={axes}")
    specs = _specs_inside(config, axes) if sharded else None
    _check_inputs(params, idx, config, cache, specs)
    if axes.data is not None:  # the data-parallel gradient all-reduce: one per param (purejax/parallel/data.py)
        params = parallel.vary(params, specs, axes.data)
    if axes.fsdp:
        top = {name: value for name, value in params.items() if name != "blocks"}
        top = parallel.gather(top, {name: specs[name] for name in top}, axes.data)
        params = {**top, "blocks": params["blocks"]}
    return params, specs, axes


def _hidden(
    params: Params, specs: Params | None, idx: Any, config: GPTConfig, key: Any, cache: Any, axes: MeshAxes
) -> tuple[Array, Cache | None]:
    dropout_on = key is not None and config.dropout > 0
    if dropout_on and axes.data is not None:
        # Each data shard holds other examples, so it needs masks of its own; over the model axis the key
        # stays the same, so the replicated activations get the same mask on every device that holds them.
        key = jax.random.fold_in(key, jax.lax.axis_index(axes.data))
    keys = prandom.named_keys(key, "embd", "blocks") if dropout_on else {"embd": None}
    start = 0 if cache is None else cache["index"][0]  # every layer has written the same number of positions
    positions = start + jnp.arange(idx.shape[1])
    # A position past the table (a cache written beyond block_size) looks up NaNs: wrong output is visible.
    x = embedding.apply(params["wte"], idx, axis_name=axes.model) + embedding.apply(params["wpe"], positions)
    x = dropout.apply(x, config.dropout, keys["embd"])

    def layer(p, x, key=None, cache=None):
        return block(p, x, config, key, cache, axes)

    if axes.fsdp:  # ZeRO-3: gather one block's params, use them, drop them; gather again for the backward pass
        layer = _gathered_layer(layer, parallel.layer_specs(specs["blocks"]), axes.data)

    per_layer = {}  # what each layer gets of its own: a dropout key, its slice of the cache
    if dropout_on:
        per_layer["key"] = stack.layer_keys(keys["blocks"], config.n_layer)
    if cache is not None:
        per_layer["cache"] = cache
    run = stack.scan if config.layers == "scan" else _loop
    if per_layer:
        x, cache = run(lambda p, x, xs: layer(p, x, **xs), params["blocks"], x, xs=per_layer)
    else:
        x = run(lambda p, x: layer(p, x)[0], params["blocks"], x)
    return layer_norm.apply(params["ln_f"], x), cache


def _gathered_layer(layer: Any, specs: Params, axis: str) -> Any:
    """`layer` on its params all-gathered over `axis` first, under `jax.checkpoint`: nothing of the block is
    kept for the backward pass, which gathers the params again and recomputes the block, so only one block's
    whole params exist at a time (ZeRO-3 with activation checkpointing). AD turns each all_gather into a
    psum_scatter of the gradient (purejax/parallel/fsdp.py). A finer policy that saved every activation but the
    gathered params let XLA:CPU keep the gathered params of every layer alive instead (jax 0.10.2)."""

    def gathered(p, x, key=None, cache=None):
        return layer(parallel.gather(p, specs, axis), x, key, cache)

    return jax.checkpoint(gathered, policy=jax.checkpoint_policies.nothing_saveable)


def _loop(block_apply, blocks: Params, x: Array, **kwargs) -> Any:
    """stack.loop over the stacked params, sliced per layer (free under jit)."""
    return stack.loop(block_apply, stack.unstack(blocks), x, **kwargs)


def apply(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    cache: Cache | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, "batch seq vocab"] | tuple[Float[Array, "batch seq vocab"], Cache]:
    """Logits for every position. With a `key`, dropout is on (training). With a `cache` (from `init_cache`),
    returns `(logits, new_cache)`: the tokens are appended to the cached ones (incremental decoding).
    With `axes` (inside `shard_map`), this device's slice of the vocabulary under tensor parallelism."""
    params, specs, axes = _prepare(params, idx, config, cache, axes)
    h, new_cache = _hidden(params, specs, idx, config, key, cache, axes)
    logits = embedding.attend(params["wte"], h)  # the tied head
    return logits if cache is None else (logits, new_cache)


def loss(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: GPTConfig,
    key: PRNGKeyArray | None = None,
    *,
    axes: MeshAxes | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of `(idx, targets)`, in float32; targets of -1 are ignored and not
    counted (nanoGPT's `ignore_index=-1`). With `axes`, the mean over the whole batch, all data shards
    together (its gradient needs no further averaging; purejax/parallel/step.py says why), from the
    vocab-parallel logits without gathering them."""
    axes = MeshAxes() if axes is None else axes
    idx, targets = batch
    logits = apply(params, idx, config, key=key, axes=axes)
    per_token = losses.cross_entropy(logits, targets, ignore_index=-1, axis_name=axes.model)
    return losses.masked_mean(per_token, jnp.asarray(targets) != -1, axis_name=axes.data)


# ---------------------------------------------------------------- incremental decoding


def init_cache(config: GPTConfig, batch: int, dtype: Any = jnp.float32) -> Cache:
    """An empty key/value cache for `block_size` positions, one attention cache per layer stacked on a leading
    n_layer axis: {"k", "v": (n_layer, batch, block_size, n_head, head_dim), "index": (n_layer,) int32}."""
    one = attention.init_cache(config.attention, batch, config.block_size, dtype)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layer, *a.shape)), one)


def generate(
    params: Params,
    prompt: Integer[ArrayLike, "batch prompt"],
    config: GPTConfig,
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float | Float[ArrayLike, ""] = 1.0,
    top_k: int | None = None,
    top_p: float | Float[ArrayLike, ""] | None = None,
) -> Int[Array, "batch total"]:
    """The prompt followed by `max_new_tokens` sampled tokens, int32 (batch, prompt + max_new_tokens).

    Semantics are nanoGPT's `generate`: the model sees at most the last block_size tokens; the next token is
    drawn from softmax(logits / temperature) after top-k and top-p filtering (`purejax.sampling`), and
    temperature 0 takes the arg-max. Step i draws with `fold_in(key, i)`.

    How it runs: the (cropped) prompt fills a key/value cache in one pass, then one `lax.scan` step per new
    token feeds just that token. Once the sequence outgrows block_size, nanoGPT crops it to its last
    block_size tokens and recomputes: every token's position shifts by one, so the cached keys and values
    are stale. The scan does the same, `lax.cond` picking the cached step while the cache has room and the
    full recompute over the last block_size tokens after. Everything is jitted: one compilation per
    (params shapes, prompt shape, config, max_new_tokens, top_k, and whether top_p is None), whatever the
    temperature, top_p, key or number of tokens.
    """
    sampling.check_args(temperature=temperature, top_k=top_k, top_p=top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt.shape[1] == 0:
        raise ValueError("generate: the prompt is empty; give at least one token per row (shape (batch, >= 1))")
    return _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k"))
def _generate(params, prompt, config, key, max_new_tokens, temperature, top_k, top_p) -> Array:
    batch, n_prompt = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.zeros((batch, max_new_tokens), prompt.dtype)], axis=1).astype(jnp.int32)
    if max_new_tokens == 0:
        return tokens
    context = tokens[:, max(0, n_prompt - config.block_size) : n_prompt]  # nanoGPT crops the prompt to the block

    def next_token(logits, i):
        return sampling.sample(jax.random.fold_in(key, i), logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def last_logits(h):
        return embedding.attend(params["wte"], h[:, -1])

    def cached_step(tokens, cache, i):  # feed only token n_prompt + i, at the cache's next position
        h, cache = hidden(params, jax.lax.dynamic_slice_in_dim(tokens, n_prompt + i, 1, axis=1), config, cache=cache)
        return last_logits(h), cache

    def recompute(tokens, cache, i):  # the sequence outgrew the block: its last block_size tokens, from scratch
        window = jax.lax.dynamic_slice_in_dim(tokens, n_prompt + i + 1 - config.block_size, config.block_size, axis=1)
        return last_logits(hidden(params, window, config)[0]), cache

    def step(carry, i):  # draw token n_prompt + i, then the logits that follow it
        tokens, logits, cache = carry
        tokens = tokens.at[:, n_prompt + i].set(next_token(logits, i))
        if context.shape[1] + max_new_tokens - 1 > config.block_size:  # static: can the cache run out?
            has_room = cache["index"][0] < config.block_size
            logits, cache = jax.lax.cond(has_room, cached_step, recompute, tokens, cache, i)
        else:
            logits, cache = cached_step(tokens, cache, i)
        return (tokens, logits, cache), None

    h, cache = hidden(params, context, config, cache=init_cache(config, batch, params["wte"]["w"].dtype))
    carry = (tokens, last_logits(h), cache)
    (tokens, logits, _), _ = jax.lax.scan(step, carry, jnp.arange(max_new_tokens - 1))
    return tokens.at[:, -1].set(next_token(logits, max_new_tokens - 1))


# ---------------------------------------------------------------- surgery and accounting


def crop_block_size(params: Params, config: GPTConfig, block_size: int) -> tuple[Params, GPTConfig]:
    """A model with a shorter context: the first `block_size` learned positions are kept (nanoGPT's model
    surgery, e.g. to fine-tune GPT-2's 1024-token model at 256). Returns new params and config."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= config.block_size:
        raise ValueError(
            f"crop_block_size: block_size must be an int in [1, {config.block_size}] (the current block_size), "
            f"got {block_size!r}; a model cannot be extended to positions it never learned"
        )
    params = {**params, "wpe": {**params["wpe"], "w": params["wpe"]["w"][:block_size]}}
    return params, dataclasses.replace(config, block_size=block_size)


def crop_vocab(params: Params, config: GPTConfig, vocab_size: int) -> tuple[Params, GPTConfig]:
    """A model over only the first `vocab_size` token ids: the rest of the embedding table (the padding
    nanoGPT adds to GPT-2's 50257, or that tensor parallelism adds to split the table evenly) is dropped, so
    the tied head never produces, and sampling never picks, an id the tokenizer cannot decode. The real
    tokens' logits are unchanged. Returns new params and config."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= config.vocab_size:
        raise ValueError(f"crop_vocab: vocab_size must be an int in [1, {config.vocab_size}] (the current vocab_size), "
                         f"got {vocab_size!r}")  # fmt: skip
    params = {**params, "wte": {**params["wte"], "w": params["wte"]["w"][:vocab_size]}}
    return params, dataclasses.replace(config, vocab_size=vocab_size)


def num_params(params: Params, non_embedding: bool = True) -> int:
    """Number of parameters. With `non_embedding`, the position embeddings are left out, as nanoGPT counts;
    the token embeddings stay in because they are also the output head's weights."""
    return tree_lib.count(params) - (tree_lib.count(params["wpe"]) if non_embedding else 0)


def flops_per_token(config: GPTConfig) -> int:
    """Forward plus backward FLOPs per token, nanoGPT's estimate (PaLM paper, appendix B): 6N for the matmuls
    with the N non-embedding parameters, plus 12 * n_layer * n_head * head_dim * block_size for attention."""
    shapes = jax.eval_shape(partial(init, config=config), jax.random.key(0))
    n = num_params(shapes)
    head_dim = config.n_embd // config.n_head
    return 6 * n + 12 * config.n_layer * config.n_head * head_dim * config.block_size


def estimate_mfu(config: GPTConfig, tokens_per_second: float | int, peak_flops: float | int) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per second at this throughput, as a fraction of the
    hardware's `peak_flops` (nanoGPT compares with an A100's 312e12 bfloat16 FLOP/s)."""
    if peak_flops <= 0:
        raise ValueError(f"estimate_mfu: peak_flops must be positive, got {peak_flops}")
    return flops_per_token(config) * tokens_per_second / peak_flops


# ---------------------------------------------------------------- checks


def _check_inputs(params: Params, idx: Any, config: GPTConfig, cache: Cache | None, specs: Params | None) -> None:
    """Trace-time checks (free under jit) that name what does not fit: the ids, the params, the cache."""
    check_keys(params, "gpt", required=("wte", "wpe", "blocks", "ln_f"))
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"gpt: idx must hold integer token ids, got {idx.dtype}")
    seq = idx.shape[1]
    if seq > config.block_size:
        raise ValueError(
            f"gpt: cannot forward a sequence of length {seq}, block_size is only {config.block_size}; "
            f"crop the input to its last {config.block_size} tokens"
        )
    if specs is not None:  # on a mesh: every leaf must be this device's shard of the param
        sizes = {name: jax.lax.axis_size(name) for spec in jax.tree.leaves(specs) for name in parallel.spec_axes(spec)}
        local = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(parallel.local_shape(s.shape, spec, sizes), s.dtype), _shapes(config), specs
        )
        report = tree_lib.diff(params, local, check_dtype=False)
        if not report.ok:
            raise tree_lib.TreeMismatchError(
                report.format("gpt params (this device's shards, as param_specs(config, axes, mesh.shape) says)")
                + "\nwere they placed with parallel.shard(params, param_specs(...), mesh) and passed through "
                "shard_map with those specs?"
            )
        return
    want = {"wte.w": (config.vocab_size, config.n_embd), "wpe.w": (config.block_size, config.n_embd)}
    got = {name: tuple(tree_lib.subtree(params, name).shape) for name in want}
    depth = stack.depth(params["blocks"], "params['blocks']")
    if got != want or depth != config.n_layer:
        raise ValueError(
            f"gpt: params do not fit the config: wte {got['wte.w']}, wpe {got['wpe.w']} and {depth} stacked "
            f"blocks, but {config} needs wte {want['wte.w']}, wpe {want['wpe.w']} and n_layer={config.n_layer}; "
            f"were the params made with another config (or cropped with crop_block_size)?"
        )
    if cache is not None:
        check_keys(cache, "gpt cache", required=("k", "v", "index"))
        if stack.depth(cache, "cache") != config.n_layer:
            raise ValueError(
                f"gpt: the cache has {stack.depth(cache, 'cache')} layers, the config {config.n_layer}; "
                f"make it with init_cache(config, batch)"
            )
