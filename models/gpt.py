"""GPT (Radford et al. 2019), the model of nanoGPT's model.py, as pure functions over a dict of arrays.

    idx (batch, seq) int
      -> wte[idx] + wpe[positions] -> dropout                        x (batch, seq, n_embd)
      -> n_layer blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x))   x (batch, seq, n_embd)
      -> ln_f -> x @ wte.T                                           logits (batch, seq, vocab_size)

params = {"wte": embedding (vocab_size, n_embd), "wpe": embedding (block_size, n_embd),
          "blocks": {"ln_1", "attn": {"qkv", "proj"}, "ln_2", "mlp": {"fc", "proj"}, every leaf stacked on a
                     leading n_layer axis}, "ln_f"}.
There is no "lm_head": the output head is the token embedding transposed (weight tying, Press & Wolf 2017).
The blocks run under `lax.scan` or as a Python loop (`layers`: the default "auto" loops over shallow stacks).

Beside this page: `gpt_decode` (a key/value cache, `generate`), `gpt_parallel` (the same functions on a device
mesh), `gpt_surgery` (cropping context or vocabulary). The one mesh concept here is `axis_name`, Megatron-LM
tensor parallelism's axis: heads, MLP units and vocabulary split over it inside `shard_map`, each part psummed.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from models import gpt_moe
from purejax import losses
from purejax import random as prandom
from purejax import tree as tree_lib
from purejax.nn import activations, attention, check_keys, dropout, embedding, initializers, layer_norm, mlp, stack
from purejax.nn import remat as remat_lib

Params = dict[str, Any]


@dataclass(frozen=True)
class GPTConfig:
    """Static description of a GPT; frozen and hashable, so it can be a static argument to jax.jit. The names
    are nanoGPT's (`n_embd` where purejax.nn says `d_model`), so its configs map one to one.

    Arguments:
        block_size: the longest context, and the number of learned positions.
        vocab_size: number of token ids (GPT-2's 50257 padded to 50304 is nanoGPT's default: a multiple of 64).
        n_layer, n_head, n_embd: depth, attention heads and width; n_head must divide n_embd.
        dropout: rate after the embeddings, on attention probabilities and after each residual branch,
            applied only when `apply` gets a key.
        bias: biases in linear layers and LayerNorms, as GPT-2; False is nanoGPT's "a bit better and faster".
        gelu: "exact" (erf, torch's nn.GELU default, nanoGPT) or "tanh" (the approximation GPT-2 was trained with).
        layers: "auto", the default (a loop up to `stack.AUTO_LOOP_DEPTH` layers, a scan beyond or for
            rematerialised blocks: `run_blocks`), "scan" (compile time flat in depth) or "loop" (unrolled, which
            XLA may fuse across layers); the same maths, equal to float32 rounding (fused differently).
        remat: "none", "block" or a policy: what each block keeps for the backward pass (purejax/nn/remat.py).
        attention_impl: passed to `purejax.nn.attention` ("auto", "fused" or "einsum").
        n_experts, expert_top_k, capacity_factor, moe_aux_weight: n_experts > 0 makes every block's MLP a
            mixture of experts with top-k routing, a capacity (0: none) and a load-balancing loss (gpt_moe.py).
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    gelu: Literal["exact", "tanh"] = "exact"
    layers: stack.Mode = "auto"
    attention_impl: attention.Impl = "auto"
    remat: str = "none"
    n_experts: int = 0
    expert_top_k: int = 2
    capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01

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
        for name, allowed in (("gelu", ("exact", "tanh")), ("layers", stack.MODES), ("remat", remat_lib.CHOICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        gpt_moe.check_config(self)
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (impl, dropout) surface here

    @property
    def attention(self) -> attention.AttentionConfig:
        return attention.AttentionConfig(
            d_model=self.n_embd,
            n_head=self.n_head,
            bias=self.bias,
            causal=True,
            dropout=self.dropout,
            impl=self.attention_impl,
        )

    @property
    def activation(self) -> Callable[[Array], Array]:
        """The MLP's GELU, as `gelu` names it."""
        return activations.gelu if self.gelu == "exact" else activations.gelu_tanh


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
        if config.n_experts:  # a mixture of experts in place of the MLP (gpt_moe.py)
            ffn = {"moe": gpt_moe.init(keys["mlp"], config, w_init=normal, proj_init=residual)}
        else:
            ffn = {"mlp": mlp.init(keys["mlp"], d, 4 * d, bias=config.bias, w_init=normal, proj_init=residual)}
        return {
            "ln_1": layer_norm.init(None, d, bias=config.bias),
            "attn": attention.init(keys["attn"], config.attention, w_init=normal, proj_init=residual),
            "ln_2": layer_norm.init(None, d, bias=config.bias),
            **ffn,
        }

    return {
        "wte": embedding.init(keys["wte"], config.vocab_size, d, w_init=normal),
        "wpe": embedding.init(keys["wpe"], config.block_size, d, w_init=normal),
        "blocks": stack.init(keys["blocks"], config.n_layer, block_init),
        "ln_f": layer_norm.init(None, d, bias=config.bias),
    }


def block_with_stats(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    moe_axes: gpt_moe.MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], gpt_moe.Stats]:
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)), and the mixture of
    experts' statistics (none for a dense MLP). Under tensor parallelism x is replicated over `axis_name`;
    attention and the MLP each end with one psum over it."""
    keys = prandom.named_keys(key, "attn", "mlp") if key is not None else {"attn": None, "mlp": None}
    h = layer_norm.apply(params["ln_1"], x)
    x = x + attention.apply(params["attn"], h, config.attention, key=keys["attn"], axis_name=axis_name)
    h = layer_norm.apply(params["ln_2"], x)
    if "moe" in params:
        y, stats = gpt_moe.apply(params["moe"], h, config, key=keys["mlp"], axis_name=axis_name, moe_axes=moe_axes)
    else:
        y, stats = (
            mlp.apply(
                params["mlp"],
                h,
                activation=config.activation,
                dropout=config.dropout,
                key=keys["mlp"],
                axis_name=axis_name,
            ),
            {},
        )
    return x + y, stats


def block(params: Params, x: Float[Array, "batch seq d_model"], config: GPTConfig, **kwargs: Any) -> Array:
    """`block_with_stats`'s output without the statistics."""
    return block_with_stats(params, x, config, **kwargs)[0]


def hidden(params: Params, idx: Integer[ArrayLike, "batch seq"], config: GPTConfig, **kwargs: Any) -> Array:
    """`hidden_with_stats`'s output, (batch, seq, d_model), without the statistics."""
    return hidden_with_stats(params, idx, config, **kwargs)[0]


def hidden_with_stats(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    wrap_block: Callable | None = None,
    moe_axes: gpt_moe.MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], gpt_moe.Stats]:
    """Token ids to the final LayerNorm's output (the tied head's input) and the MoE statistics summed over layers."""
    idx = jnp.asarray(idx)
    check_inputs(params, idx, config, axis_name=axis_name)
    dropout_on = key is not None and config.dropout > 0
    keys = prandom.named_keys(key, "embd", "blocks") if dropout_on else {"embd": None, "blocks": None}
    positions = jnp.arange(idx.shape[1])
    x = embedding.apply(params["wte"], idx, axis_name=axis_name) + embedding.apply(params["wpe"], positions)
    x = dropout.apply(x, rate=config.dropout, key=keys["embd"])

    def layer(p, carry, key):
        x, stats = block_with_stats(p, carry[0], config, key=key, axis_name=axis_name, moe_axes=moe_axes)
        return x, jax.tree.map(jnp.add, carry[1], stats)

    carry = (x, gpt_moe.no_stats(config))
    x, stats = run_blocks(layer, params["blocks"], carry, config, key=keys["blocks"], wrap_block=wrap_block)
    return layer_norm.apply(params["ln_f"], x), stats


def run_blocks(
    layer: Callable,
    blocks: Params,
    carry: Any,
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None,
    wrap_block: Callable | None = None,
) -> Any:
    """`layer(layer_params, carry, key) -> carry` over the stacked blocks, wrapped by `wrap_block` (gpt_parallel's
    FSDP gather, under jax.checkpoint) and `config.remat`, as a scan or a loop (`config.layers`; "auto" scans wrapped
    blocks as rematerialised ones). Layer i's key is `fold_in(key, i)`, so scan and loop drop the same units."""
    mode = stack.resolve(config.layers, config.n_layer, remat=config.remat != "none" or wrap_block is not None)
    layer = remat_lib.wrap(wrap_block(layer) if wrap_block else layer, config.remat, prevent_cse=mode == "loop")
    if key is None:
        return stack.apply(mode, lambda p, c: layer(p, c, None), blocks, carry)
    xs = stack.layer_keys(key, config.n_layer)
    return stack.apply(mode, lambda p, c, k: (layer(p, c, k), None), blocks, carry, xs=xs)[0]


def apply(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "batch seq vocab"]:
    """Logits for every position. With a `key`, dropout is on (training). With `axis_name` (tensor
    parallelism, inside `shard_map`), this device's slice of the vocabulary."""
    h = hidden(params, idx, config, key=key, axis_name=axis_name)
    return embedding.attend(params["wte"], h)  # the tied head


def loss(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of `(idx, targets)`, in float32; targets of -1 are ignored and not
    counted (nanoGPT's `ignore_index=-1`). With `axis_name`, from the vocab-parallel logits, never gathered.
    With experts, plus the weighted load-balancing loss (`gpt_moe.aux_loss`)."""
    idx, targets = batch
    h, stats = hidden_with_stats(params, idx, config, key=key, axis_name=axis_name)
    per_token = losses.cross_entropy(embedding.attend(params["wte"], h), targets, ignore_index=-1, axis_name=axis_name)
    mean = losses.masked_mean(per_token, jnp.asarray(targets) != -1)
    return mean + gpt_moe.aux_loss(stats, config) if stats else mean


# ---------------------------------------------------------------- accounting (surgery: gpt_surgery.py)


def num_params(params: Params, non_embedding: bool = True) -> int:
    """Number of parameters. With `non_embedding`, the position embeddings are left out, as nanoGPT counts;
    the token embeddings stay in because they are also the output head's weights."""
    return tree_lib.count(params) - (tree_lib.count(params["wpe"]) if non_embedding else 0)


def flops_per_token(config: GPTConfig) -> int:
    """Forward plus backward FLOPs per token, nanoGPT's estimate (PaLM paper, appendix B): 6N for the matmuls
    with the N non-embedding parameters (a token's expert_top_k experts of n_experts, with experts), plus
    12 * n_layer * n_head * head_dim * block_size for attention."""
    shapes = jax.eval_shape(functools.partial(init, config=config), jax.random.key(0))
    n = num_params(shapes) - gpt_moe.idle_params(shapes, config)
    return 6 * n + 12 * config.n_layer * config.n_head * (config.n_embd // config.n_head) * config.block_size


def estimate_mfu(config: GPTConfig, tokens_per_second: float | int, peak_flops: float | int) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per second at this throughput, as a fraction of the
    hardware's `peak_flops` (nanoGPT compares with an A100's 312e12 bfloat16 FLOP/s)."""
    if peak_flops <= 0:
        raise ValueError(f"estimate_mfu: peak_flops must be positive, got {peak_flops}")
    return flops_per_token(config) * tokens_per_second / peak_flops


def check_inputs(params: Params, idx: Array, config: GPTConfig, *, axis_name: str | None = None) -> None:
    """Trace-time checks (free under jit) that name what does not fit: the ids and the params (this device's
    rows of wte under tensor parallelism). gpt_decode and gpt_parallel call it too."""
    check_keys(params, "gpt", required=("wte", "wpe", "blocks", "ln_f"))
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"gpt: idx must hold integer token ids, got {idx.dtype}")
    if idx.shape[1] > config.block_size:
        raise ValueError(
            f"gpt: cannot forward a sequence of length {idx.shape[1]}, block_size is only {config.block_size}; "
            f"crop the input to its last {config.block_size} tokens"
        )
    tp = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    want = {"wte.w": (config.vocab_size // tp, config.n_embd), "wpe.w": (config.block_size, config.n_embd)}
    got = {name: tuple(tree_lib.subtree(params, name).shape) for name in want}
    depth = stack.depth(params["blocks"], "params['blocks']")
    if got != want or depth != config.n_layer:
        shards = f" (its rows split over the {tp} devices of {axis_name!r})" if tp > 1 else ""
        raise ValueError(
            f"gpt: params do not fit the config: wte {got['wte.w']}, wpe {got['wpe.w']} and {depth} stacked "
            f"blocks, but {config} needs wte {want['wte.w']}{shards}, wpe {want['wpe.w']} and "
            f"n_layer={config.n_layer}; were the params made with another config (or cropped, gpt_surgery.py)?"
        )
