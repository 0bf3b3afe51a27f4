"""Llama (Touvron et al. 2023; Llama 2 and 3), the decoder of Hugging Face's modeling_llama, as pure functions
over a dict of arrays.

    idx (batch, seq) int
      -> embed[idx]                                                        x (batch, seq, d_model)
      -> n_layer blocks: x + attn(rms(x)), then x + swiglu(rms(x))         x (batch, seq, d_model)
      -> rms -> x @ head (or x @ embed.T when tied)                        logits (batch, seq, vocab_size)

What differs from the GPT of gpt.py, each a later paper's change: RMSNorm instead of LayerNorm (Zhang &
Sennrich 2019), rotary position embeddings on the queries and keys instead of a learned position table (Su et al.
2021; `purejax.nn.rotary`), a SwiGLU MLP (Shazeer 2020; `purejax.nn.gated_mlp`), grouped-query attention
(Ainslie et al. 2023: n_kv_head key/value heads shared by n_head query heads, 1 = multi-query), no biases, and an
untied output head (Llama 3.2's small models tie it; `tie_embeddings`).

params = {"embed": embedding (vocab_size, d_model),
          "blocks": {"attn_norm", "attn": {"qkv", "proj"}, "mlp_norm", "mlp": {"gate", "up", "down"}, every leaf
                     stacked on a leading n_layer axis},
          "norm", "head": {"w": (d_model, vocab_size)} (absent when tied)}.
attn.qkv's columns are in `purejax.nn.attention`'s grouped order ([q.. k v] per key/value head), not Hugging
Face's separate q_proj / k_proj / v_proj: `attention.qkv_permutation` converts (llama_hf.py does).

Beside this page: `llama_decode` (a key/value cache sized by the kv heads), `llama_parallel` (on a device mesh),
`llama_hf` (Hugging Face weights), `llama_flops` (parameters, FLOPs). The one mesh concept here is `axis_name`,
as in gpt.py.
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from purejax import losses
from purejax import random as prandom
from purejax import tree as tree_lib
from purejax.nn import attention, check_keys, embedding, gated_mlp, initializers, linear, rms_norm, rotary, stack
from purejax.nn import remat as remat_lib
from purejax.nn.rotary import LinearScaling, Llama3Scaling, RopeScaling

Params = dict[str, Any]


@dataclass(frozen=True)
class LlamaConfig:
    """Static description of a Llama; frozen and hashable, so it can be a static argument to jax.jit.

    Arguments:
        vocab_size, n_layer, d_model: token ids, depth, width.
        n_head, n_kv_head: query heads and key/value heads; n_head divides d_model (head_dim = d_model // n_head,
            which must be even for rotary), n_kv_head divides n_head (1: multi-query attention).
        d_ff: the SwiGLU hidden width (Llama 2 7B: 11008 for d_model 4096, about 8/3 d_model).
        max_seq_len: the longest context (Hugging Face's max_position_embeddings), and the size of a decoding
            cache by default; rotary needs no table, so it sets no parameter's shape.
        rope_theta: the rotary base (10000 in Llama 2, 500000 in Llama 3).
        rope_scaling: None, `LinearScaling(factor)` or `Llama3Scaling(...)` (`purejax.nn.rotary`).
        norm_eps: RMSNorm's epsilon (Hugging Face's rms_norm_eps).
        tie_embeddings: the output head is embed.w transposed (no "head" param), as Llama 3.2 1B and 3B.
        layers, remat: as GPTConfig's (`stack.run`): "scan" (the default here), "loop" or "auto"; "none",
            "block" or a policy, what each block keeps for the backward pass (purejax/nn/remat.py).
        attention_impl: passed to `purejax.nn.attention` ("auto", "fused" or "einsum").
    """

    vocab_size: int = 32000
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 12
    d_model: int = 768
    d_ff: int = 2048
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    layers: stack.Mode = "scan"
    attention_impl: attention.Impl = "auto"
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"LlamaConfig: d_model={self.d_model} must split into n_head={self.n_head} heads of an even width "
                f"(rotary turns features in pairs); pick n_head so that d_model // n_head is a whole even number"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig: n_kv_head={self.n_kv_head} must divide n_head={self.n_head}: each key/value head "
                f"serves an equal group of query heads (n_kv_head=1 is multi-query attention)"
            )
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError(
                f"LlamaConfig: rope_theta and norm_eps must be positive, got {self.rope_theta}, {self.norm_eps}"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, (LinearScaling, Llama3Scaling)):
            raise ValueError(
                f"LlamaConfig: rope_scaling must be None, rotary.LinearScaling or rotary.Llama3Scaling, "
                f"got {self.rope_scaling!r}"
            )
        for name, allowed in (("layers", stack.MODES), ("remat", remat_lib.CHOICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LlamaConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (impl) surface here

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def attention(self) -> attention.AttentionConfig:
        return attention.AttentionConfig(
            d_model=self.d_model,
            n_head=self.n_head,
            n_kv_head=self.n_kv_head,
            bias=False,
            causal=True,
            impl=self.attention_impl,
        )


def init(key: PRNGKeyArray, config: LlamaConfig) -> Params:
    """Hugging Face's initialisation of a new Llama: every weight N(0, 0.02^2) (initializer_range), the
    RMSNorm scales ones."""
    keys = prandom.named_keys(key, "embed", "blocks", "norm", "head")
    normal = initializers.normal(0.02)
    params = {
        "embed": embedding.init(keys["embed"], config.vocab_size, config.d_model, w_init=normal),
        "blocks": stack.init(keys["blocks"], config.n_layer, lambda k: init_block(k, config)),
        "norm": rms_norm.init(keys["norm"], config.d_model),
    }
    if not config.tie_embeddings:
        params["head"] = linear.init(keys["head"], config.d_model, config.vocab_size, bias=False, w_init=normal)
    return params


def init_block(key: PRNGKeyArray, config: LlamaConfig) -> Params:
    """One block's params (`init` stacks n_layer of them)."""
    keys, normal = prandom.named_keys(key, "attn_norm", "attn", "mlp_norm", "mlp"), initializers.normal(0.02)
    return {
        "attn_norm": rms_norm.init(keys["attn_norm"], config.d_model),
        "attn": attention.init(keys["attn"], config.attention, w_init=normal),
        "mlp_norm": rms_norm.init(keys["mlp_norm"], config.d_model),
        "mlp": gated_mlp.init(keys["mlp"], config.d_model, config.d_ff, w_init=normal),
    }


def rotary_qkv(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    positions: Integer[Array, "... seq"],
    config: LlamaConfig,
    *,
    axis_name: str | None = None,
) -> tuple[
    Float[Array, "batch seq n_head head_dim"],
    Float[Array, "batch seq n_kv_head head_dim"],
    Float[Array, "batch seq n_kv_head head_dim"],
]:
    """The attention's q and k, v heads, q and k rotated to their `positions`: (seq,) for every row, or
    (batch, seq), each row its own (llama_decode, which caches k and v). Under tensor parallelism, this device's
    heads: n_head and n_kv_head are its share."""
    q, k, v = attention.qkv_heads(params, x, config.attention, axis_name=axis_name)
    rotate = dict(theta=config.rope_theta, scaling=config.rope_scaling)
    return rotary.apply(q, positions, **rotate), rotary.apply(k, positions, **rotate), v


def self_attention(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    positions: Integer[Array, " seq"],
    config: LlamaConfig,
    *,
    axis_name: str | None = None,
) -> Float[Array, "batch seq d_model"]:
    """Causal grouped-query attention with rotary queries and keys; one psum over `axis_name` (in proj)."""
    q, k, v = rotary_qkv(params, x, positions, config, axis_name=axis_name)
    batch, seq, n_head, _ = q.shape
    causal = attention.combine_masks(None, config.attention, n_head, jnp.arange(seq), jnp.arange(seq), batch=batch)
    out = attention.attend(q, k, v, causal, config.attention, axis_name=axis_name, is_causal=config.attention.causal)
    return linear.apply(params["proj"], out.reshape(batch, seq, -1), axis_name=axis_name)


def block(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    positions: Integer[Array, " seq"],
    config: LlamaConfig,
    *,
    axis_name: str | None = None,
) -> Float[Array, "batch seq d_model"]:
    """One pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)). Under tensor parallelism x is
    replicated over `axis_name`; attention and the MLP each end with one psum over it."""
    if axis_name is None:  # whole params: check every path (sharded ones are checked by the layers, per shard)
        _check_block(params, config)
    h = rms_norm.apply(params["attn_norm"], x, eps=config.norm_eps)
    x = x + self_attention(params["attn"], h, positions, config, axis_name=axis_name)
    h = rms_norm.apply(params["mlp_norm"], x, eps=config.norm_eps)
    return x + gated_mlp.apply(params["mlp"], h, axis_name=axis_name)


def hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    positions: Integer[ArrayLike, " seq"] | None = None,
) -> Float[Array, "batch seq d_model"]:
    """Token ids to the final RMSNorm's output, the head's input; the blocks run as `config.layers` and
    `config.remat` say (`stack.run`, as the GPT's). `positions` are the tokens' positions, arange(seq) unless
    given (a continuation at an offset). `key` is unused (no dropout): GPT and Llama are called alike."""
    idx = jnp.asarray(idx)
    check_inputs(params, idx, config, axis_name=axis_name)
    positions = jnp.arange(idx.shape[1]) if positions is None else jnp.asarray(positions)
    x = embedding.apply(params["embed"], idx, axis_name=axis_name)

    def layer(layer_params, x, key):  # no dropout: the key is None
        return block(layer_params, x, positions, config, axis_name=axis_name)

    x = stack.run(layer, params["blocks"], x, mode=config.layers, remat=config.remat)
    return rms_norm.apply(params["norm"], x, eps=config.norm_eps)


def unembed(params: Params, h: Float[Array, "*batch d_model"], config: LlamaConfig) -> Float[Array, "*batch vocab"]:
    """The output head: h @ head.w, or h @ embed.w.T when tied; this device's vocabulary slice under TP."""
    return embedding.attend(params["embed"], h) if config.tie_embeddings else linear.apply(params["head"], h)


def apply(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "batch seq vocab"]:
    """Logits for every position. With `axis_name` (tensor parallelism, inside `shard_map`), this device's
    slice of the vocabulary. No dropout, Llama trains without it: `key` is unused (the GPT's signature)."""
    return unembed(params, hidden(params, idx, config, axis_name=axis_name), config)


def loss(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of `(idx, targets)`, in float32; targets of -1 are ignored and not
    counted. With `axis_name`, from the vocab-parallel logits, never gathered. `key` is unused (no dropout)."""
    logits = apply(params, batch[0], config, axis_name=axis_name)
    per_token = losses.cross_entropy(logits, batch[1], ignore_index=-1, axis_name=axis_name)
    return losses.masked_mean(per_token, jnp.asarray(batch[1]) != -1)


def check_inputs(params: Params, idx: Array, config: LlamaConfig, *, axis_name: str | None = None) -> None:
    """Trace-time checks (free under jit) that name what does not fit: the ids and the top-level params (this
    device's vocabulary rows / columns under tensor parallelism); `block` checks each layer's."""
    head = () if config.tie_embeddings else ("head",)
    try:
        check_keys(params, "llama", required=("embed", "blocks", "norm", *head))
    except KeyError as e:
        tied = f"config.tie_embeddings={config.tie_embeddings}: 'head' only when untied"
        raise KeyError(f"{e.args[0]} ({tied})") from None
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"llama: idx must hold integer token ids, got {idx.dtype}")
    if idx.ndim != 2 or idx.shape[1] > config.max_seq_len:
        raise ValueError(
            f"llama: idx has shape {tuple(idx.shape)}, expected (batch, seq) with seq <= max_seq_len="
            f"{config.max_seq_len}; crop it, or raise max_seq_len in the config"
        )
    tp = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    want = {"embed.w": (config.vocab_size // tp, config.d_model), "norm.scale": (config.d_model,)}
    want.update({} if config.tie_embeddings else {"head.w": (config.d_model, config.vocab_size // tp)})
    got = {name: tuple(tree_lib.subtree(params, name).shape) for name in want}
    depth = stack.depth(params["blocks"], "params['blocks']")
    if got != want or depth != config.n_layer:
        shards = f" (the vocabulary split over the {tp} devices of {axis_name!r})" if tp > 1 else ""
        raise ValueError(
            f"llama: params do not fit the config: {got} and {depth} stacked blocks, but {config} needs "
            f"{want}{shards} and n_layer={config.n_layer}; were the params made with another config?"
        )


def _check_block(params: Params, config: LlamaConfig) -> None:
    """One layer's params against the shapes `init_block` makes, every wrong path named."""
    expected = jax.eval_shape(lambda: init_block(jax.random.key(0), config))
    report = tree_lib.diff({"blocks": params}, {"blocks": expected}, check_dtype=False)
    if not report.ok:
        raise ValueError(report.format(f"llama: a layer of params['blocks'] (per layer, for {config})"))
