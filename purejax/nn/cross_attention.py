"""Multi-head cross-attention (Vaswani et al. 2017, the decoder's encoder-decoder attention): queries from one
sequence `x`, keys and values from another, the `context` (an encoder's output, a text prompt's embeddings),
of another length and possibly another width.

params = {"q": linear (d_model, d_model), "kv": linear (d_context, 2 * n_kv_head * head_dim),
          "proj": linear (d_model, d_model)}.
The query projection reads `x` and the key/value projection reads `context`, so the two are separate matmuls
(self-attention fuses all three into one, `purejax.nn.attention`). Keys and values share one matmul, its
columns grouped per key/value head as self-attention's are (Megatron-LM's layout, so that a contiguous split
over devices would hand each one whole heads), every head's head_dim features contiguous:

    q:  [q_0 | q_1 | ... | q_{n_head-1}]
    kv: [k_0 v_0 | k_1 v_1 | ... | k_{n_kv_head-1} v_{n_kv_head-1}]

n_kv_head < n_head is grouped-query attention: query head h reads key/value head h // (n_head // n_kv_head).
torch's `nn.MultiheadAttention(kdim=..., vdim=...)` keeps q, k and v apart as (out, in) matrices: "q" is
q_proj_weight transposed, and "kv" interleaves the transposed k and v weights head by head.

Nothing is causal here: a query and the context share no order. A key padding mask `kv_mask`, (batch, kv_len)
and True at the real context positions, hides the padding. The attention itself is self-attention's core,
`attention.attend`, in the formulation `impl` picks, with the softmax in float32.
"""

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import attention, initializers, linear
from purejax.nn import dropout as dropout_lib
from purejax.nn._check import check_keys, check_shape

Params = dict[str, Any]


@dataclass(frozen=True)
class CrossAttentionConfig:
    """Static description of a cross-attention layer; frozen and hashable, so it can be a static jit argument.

    Arguments:
        d_model: width of the queries' input `x` and of the output.
        n_head: number of query heads; must divide d_model (head_dim = d_model // n_head).
        n_kv_head: number of key/value heads; None means n_head. Fewer is grouped-query attention.
        d_context: width of the `context` the keys and values are made from; None means d_model.
        bias: whether the projections have biases.
        dropout: rate for the attention probabilities and for the output projection, applied only when
            `apply` gets a key (as `AttentionConfig.dropout`).
        impl: "auto", "fused" or "einsum", as `AttentionConfig.impl`.
    """

    d_model: int
    n_head: int
    n_kv_head: int | None = None
    d_context: int | None = None
    bias: bool = True
    dropout: float = 0.0
    impl: attention.Impl = "auto"

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.d_context is None:
            object.__setattr__(self, "d_context", self.d_model)
        if isinstance(self.d_context, bool) or not isinstance(self.d_context, int) or self.d_context <= 0:
            raise ValueError(f"CrossAttentionConfig: d_context must be a positive int, got {self.d_context!r}")
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (n_head, dropout, impl) surface here

    @property
    def attention(self) -> attention.AttentionConfig:
        """The settings of the attention core, which is never causal."""
        settings = dict(n_kv_head=self.n_kv_head, bias=self.bias, dropout=self.dropout, impl=self.impl)
        return attention.AttentionConfig(d_model=self.d_model, n_head=self.n_head, causal=False, **settings)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_width(self) -> int:
        """Output width of the key/value projection."""
        return 2 * self.n_kv_head * self.head_dim


def init(
    key: PRNGKeyArray,
    config: CrossAttentionConfig,
    *,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    proj_init: initializers.Initializer | None = None,
    dtype: Any = jnp.float32,
) -> Params:
    """`proj_init` overrides the output projection's initializer (as in `attention.init`)."""
    keys, d = prandom.named_keys(key, "q", "kv", "proj"), config.d_model
    bias = config.bias
    return {
        "q": linear.init(keys["q"], d, d, bias=bias, w_init=w_init, dtype=dtype),
        "kv": linear.init(keys["kv"], config.d_context, config.kv_width, bias=bias, w_init=w_init, dtype=dtype),
        "proj": linear.init(keys["proj"], d, d, bias=bias, w_init=proj_init or w_init, dtype=dtype),
    }


def apply(
    params: Params,
    x: Float[ArrayLike, "batch seq d_model"],
    context: Float[ArrayLike, "batch kv_len d_context"],
    config: CrossAttentionConfig,
    *,
    kv_mask: Bool[ArrayLike, "batch kv_len"] | None = None,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "batch seq d_model"]:
    """Every position of `x` attends to every (unmasked) position of `context`.

    Arguments:
        kv_mask: True at the context positions a query may attend to (the real tokens), False at padding.
            A row of the batch with no True gets the plain average of all its values, not NaN (as attention).
        key: switches dropout on (with `config.dropout > 0`); None is evaluation.
    """
    x, context = jnp.asarray(x), jnp.asarray(context)
    q, k, v = heads(params, x, context, config)
    batch, seq, kv_len = x.shape[0], x.shape[1], context.shape[1]
    mask = None
    if kv_mask is not None:
        kv_mask = check_kv_mask("cross_attention", kv_mask, batch, kv_len, "context", context)
        mask = jnp.broadcast_to(kv_mask[:, None, None, :], (batch, 1, seq, kv_len))
    drop = key is not None and config.dropout > 0
    keys = prandom.named_keys(key if drop else None, "attn", "resid")
    out = attention.attend(q, k, v, mask, config.attention, key=keys["attn"])
    y = linear.apply(params["proj"], out.reshape(batch, seq, config.d_model))
    return dropout_lib.apply(y, rate=config.dropout, key=keys["resid"])


def heads(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    context: Float[Array, "batch kv_len d_context"],
    config: CrossAttentionConfig,
) -> tuple[Array, Array, Array]:
    """q (batch, seq, n_head, head_dim) from `x`, and k, v (batch, kv_len, n_kv_head, head_dim) from `context`,
    after checking the params and both inputs against the config."""
    _check(params, x, context, config)
    batch, seq, _ = x.shape
    kv_len = context.shape[1]
    q = linear.apply(params["q"], x).reshape(batch, seq, config.n_head, config.head_dim)
    kv = linear.apply(params["kv"], context).reshape(batch, kv_len, config.n_kv_head, 2, config.head_dim)
    return q, kv[:, :, :, 0], kv[:, :, :, 1]


def check_kv_mask(
    layer: str, kv_mask: ArrayLike, batch: int, kv_len: int, source: str, like: Array
) -> Bool[Array, "batch kv_len"]:
    """`kv_mask` as a boolean (batch, kv_len) array, after checking its dtype and shape against `source`
    (the argument `like`, whose first two axes are batch and kv_len). The encoder block checks its own with it."""
    kv_mask = jnp.asarray(kv_mask)
    if kv_mask.dtype != jnp.bool_:
        raise TypeError(f"{layer}: kv_mask must be boolean (True = a real position), got {kv_mask.dtype}")
    check_shape(layer, "kv_mask", kv_mask, (batch, kv_len), f"{source} of shape {tuple(like.shape)}")
    return kv_mask


def _check(params: Params, x: Array, context: Array, config: CrossAttentionConfig) -> None:
    """Raise, naming the argument, when the params or the inputs do not fit the config or each other."""
    check_keys(params, "cross_attention", required=("q", "kv", "proj"))
    for name in ("q", "kv", "proj"):
        check_keys(params[name], f"cross_attention.{name}", required=("w",), optional=("b",))
    check_shape("cross_attention", "x", x, ("batch", "seq", config.d_model), f"d_model of config {config}")
    want = ("batch", "kv_len", config.d_context)
    check_shape("cross_attention", "context", context, want, f"d_context of config {config}")
    if context.shape[0] != x.shape[0]:
        raise ValueError(
            f"cross_attention: x has shape {tuple(x.shape)} and context {tuple(context.shape)}: "
            f"their batch sizes must be equal, one context per query sequence"
        )
    d = config.d_model
    want = {"q": (d, d), "kv": (config.d_context, config.kv_width), "proj": (d, d)}
    for name, shape in want.items():
        got = tuple(params[name]["w"].shape)
        if got != shape:
            raise ValueError(
                f"cross_attention: params['{name}']['w'] has shape {got}, but config {config} needs {shape}; "
                f"were the params made with another config?"
            )
