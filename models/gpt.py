"""GPT (Radford et al. 2019), the model of nanoGPT's model.py, as pure functions over a dict of arrays.

    idx (batch, seq) int
      -> wte[idx] + wpe[positions] -> dropout                        x (batch, seq, n_embd)
      -> n_layer blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x))   x (batch, seq, n_embd)
      -> ln_f -> x @ wte.T                                           logits (batch, seq, vocab_size)

params = {"wte": embedding (vocab_size, n_embd), "wpe": embedding (block_size, n_embd),
          "blocks": {"ln_1", "attn": {"qkv", "proj"}, "ln_2", "mlp": {"fc", "proj"}, every leaf stacked on a
                     leading n_layer axis}, "ln_f"}.
There is no "lm_head": the output head is the token embedding transposed (weight tying, Press & Wolf 2017).

Beside this page: `gpt_decode` (a key/value cache), `gpt_parallel` (on a device mesh), `gpt_moe` (experts in
the MLP's place), `gpt_flops` (parameters, FLOPs), `gpt_surgery` (cropping). The one mesh concept here is
`axis_name`, Megatron-LM tensor parallelism's axis: heads, MLP units and vocabulary split over it, psummed.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

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
        dropout: rate after the embeddings, the attention probabilities and each residual branch, with a key.
        bias: biases in linear layers and LayerNorms, as GPT-2; False is nanoGPT's "a bit better and faster".
        gelu: "exact" (erf, torch's nn.GELU default, nanoGPT) or "tanh" (the approximation GPT-2 was trained with).
        layers: "scan", "loop" or "auto" (a loop over shallow stacks, else a scan): `stack.run`, `stack.resolve`.
        remat: "none", "block" or a policy: what each block keeps for the backward pass (purejax/nn/remat.py).
        attention_impl: passed to `purejax.nn.attention` ("auto", "fused" or "einsum").

    The block's feed-forward is the config's choice (`init_feed_forward`, `feed_forward`): here the dense MLP;
    `gpt_moe.MoEConfig`, a GPTConfig with four more fields, puts a mixture of experts in its place.
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
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (impl, dropout) surface here

    @property
    def attention(self) -> attention.AttentionConfig:
        """The blocks' causal self-attention."""
        settings = dict(bias=self.bias, causal=True, dropout=self.dropout, impl=self.attention_impl)
        return attention.AttentionConfig(d_model=self.n_embd, n_head=self.n_head, **settings)

    @property
    def activation(self) -> Callable[[Array], Array]:
        """The MLP's GELU, as `gelu` names it."""
        return activations.gelu if self.gelu == "exact" else activations.gelu_tanh

    def init_feed_forward(
        self, key: PRNGKeyArray, *, w_init: initializers.Initializer, proj_init: initializers.Initializer
    ) -> Params:
        """The block's feed-forward params under their name in the block: {"mlp": n_embd -> 4 n_embd -> n_embd}."""
        d = self.n_embd
        return {"mlp": mlp.init(key, d, 4 * d, bias=self.bias, w_init=w_init, proj_init=proj_init)}

    def feed_forward(
        self,
        params: Params,
        h: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        axis_name: str | None = None,
    ) -> Float[Array, "batch seq d_model"]:
        """The block's feed-forward on `h` (the block's params in): its MLP, then dropout (with a key)."""
        activation, rate = self.activation, self.dropout
        return mlp.apply(params["mlp"], h, activation=activation, dropout=rate, key=key, axis_name=axis_name)


def init(key: PRNGKeyArray, config: GPTConfig) -> Params:
    """nanoGPT's initialisation: every linear weight and embedding N(0, 0.02^2), biases zero, LayerNorms the
    identity, and the two projections that write into the residual stream (attn.proj, mlp.proj) at
    std 0.02 / sqrt(2 * n_layer), so the stream's variance does not grow with depth (GPT-2 paper, sec. 2.3)."""
    keys = prandom.named_keys(key, "wte", "wpe", "blocks", "ln_f")
    normal = initializers.normal(0.02)
    residual = initializers.normal(0.02 / math.sqrt(2 * config.n_layer))
    d = config.n_embd

    def block_init(key):
        keys = prandom.named_keys(key, "ln_1", "attn", "ln_2", "mlp")
        return {
            "ln_1": layer_norm.init(keys["ln_1"], d, bias=config.bias),
            "attn": attention.init(keys["attn"], config.attention, w_init=normal, proj_init=residual),
            "ln_2": layer_norm.init(keys["ln_2"], d, bias=config.bias),
            **config.init_feed_forward(keys["mlp"], w_init=normal, proj_init=residual),
        }

    return {
        "wte": embedding.init(keys["wte"], config.vocab_size, d, w_init=normal),
        "wpe": embedding.init(keys["wpe"], config.block_size, d, w_init=normal),
        "blocks": stack.init(keys["blocks"], config.n_layer, block_init),
        "ln_f": layer_norm.init(keys["ln_f"], d, bias=config.bias),
    }


def embed(
    params: Params,
    idx: Integer[Array, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "batch seq d_model"]:
    """The token embeddings plus the learned positions 0..seq, then dropout (with a key)."""
    positions = jnp.arange(idx.shape[1])
    x = embedding.apply(params["wte"], idx, axis_name=axis_name) + embedding.apply(params["wpe"], positions)
    return dropout.apply(x, rate=config.dropout, key=key)


def block(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    attend: Callable[..., Array] = attention.apply,
    feed_forward: Callable[..., Array] | None = None,
) -> Float[Array, "batch seq d_model"]:
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Under tensor parallelism
    x is replicated over `axis_name`; attention and the MLP each end with one psum over it. A variant passes
    its own sublayers, called as `attention.apply` and `config.feed_forward` are (gpt_parallel: ring, sequence)."""
    keys = prandom.named_keys(key, "attn", "mlp")  # all None in evaluation
    feed_forward = config.feed_forward if feed_forward is None else feed_forward
    h = layer_norm.apply(params["ln_1"], x)
    x = x + attend(params["attn"], h, config.attention, key=keys["attn"], axis_name=axis_name)
    h = layer_norm.apply(params["ln_2"], x)
    return x + feed_forward(params, h, key=keys["mlp"], axis_name=axis_name)


def hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "batch seq d_model"]:
    """Token ids to the final LayerNorm's output, the tied head's input; the blocks run as `config.layers`
    and `config.remat` say (`stack.run`)."""
    idx = jnp.asarray(idx)
    check_inputs(params, idx, config, axis_name=axis_name)
    dropout_on = key is not None and config.dropout > 0
    keys = prandom.named_keys(key if dropout_on else None, "embd", "blocks")
    x = embed(params, idx, config, key=keys["embd"], axis_name=axis_name)

    def layer(layer_params, x, key):
        return block(layer_params, x, config, key=key, axis_name=axis_name)

    x = stack.run(layer, params["blocks"], x, mode=config.layers, remat=config.remat, key=keys["blocks"])
    return layer_norm.apply(params["ln_f"], x)


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
    counted (nanoGPT's `ignore_index=-1`). With `axis_name`, from the vocab-parallel logits, never gathered."""
    logits = apply(params, batch[0], config, key=key, axis_name=axis_name)
    per_token = losses.cross_entropy(logits, batch[1], ignore_index=-1, axis_name=axis_name)
    return losses.masked_mean(per_token, jnp.asarray(batch[1]) != -1)


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
