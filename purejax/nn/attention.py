"""Multi-head self-attention (Vaswani et al. 2017) with optional grouped key/value heads.

params: {"qkv": linear (d_model, (n_head + 2 * n_kv_head) * head_dim), "proj": linear (d_model, d_model)}.
The query, key and value projections are one fused matmul, as nanoGPT's `c_attn`. Its output columns are
grouped as in Megatron-LM: n_kv_head groups, each holding its query heads, then its key head, then its value
head, every head's head_dim features contiguous:

    [q_0 .. q_{g-1} k_0 v_0 | q_g .. q_{2g-1} k_1 v_1 | ...]     g = n_head // n_kv_head queries per group
    multi-head attention (g = 1): [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]

Why not [all q | all k | all v] (nanoGPT's and Hugging Face's c_attn)? Under tensor parallelism the columns are
split contiguously over devices, and only this layout hands every device whole groups: a query head with its
own key and value head, so attention needs no communication. `qkv_permutation` converts between the two
(models/gpt_hf.py uses it for GPT-2 files). n_kv_head < n_head is grouped-query attention (Ainslie et al.
2023): query head h reads key/value head h // g; n_kv_head == 1 is multi-query attention (Shazeer 2019).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019). `apply(..., axis_name="model")` inside `shard_map`
treats the params as this device's shards: qkv column-parallel (whole groups of heads, the number inferred
from the local weight's width), proj row-parallel (the partial products are `psum`-med over `axis_name`, then
the replicated bias is added). Each device attends with its own heads; the forward pass costs one all-reduce.

Formulations (`attend`): "fused" is XLA's `jax.nn.dot_product_attention`, "einsum" the maths written out
(`dot_product_attention`), which can drop attention probabilities. "auto" takes "einsum" for dropout and float16
on CPU (XLA:CPU cannot compile fused attention in it), cuDNN's flash attention on an NVIDIA GPU for inputs it
takes (bfloat16/float16, causal or no mask), else "fused" (purejax/nn/_attention_impl.py, which says once why
not cuDNN on a GPU). All take the softmax in float32. `purejax.nn.attention_cache` decodes with a cache;
`purejax.nn.attention_masks` says which query may attend to which key (`combine_masks`, used here).
"""

from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import _attention_impl, initializers, linear
from purejax.nn import dropout as dropout_lib
from purejax.nn._check import check_keys
from purejax.nn.attention_masks import MASKED_LOGIT, combine_masks

Params = dict[str, Any]
Impl = Literal["auto", "fused", "einsum"]


@dataclass(frozen=True)
class AttentionConfig:
    """Static description of an attention layer; frozen and hashable, so it can be a static jit argument.

    Arguments:
        d_model: width of the input and the output.
        n_head: number of query heads; must divide d_model (head_dim = d_model // n_head).
        n_kv_head: number of key/value heads; None means n_head (multi-head attention). Fewer is
            grouped-query attention and must divide n_head; 1 is multi-query attention.
        bias: whether the qkv and output projections have biases (nanoGPT's `bias`).
        causal: whether a token may attend only to itself and earlier tokens: True for a decoder, False
            for an encoder. Required, with no default, so that neither is chosen by forgetting it.
        dropout: rate for the attention probabilities and for the output projection, applied only when
            `apply` gets a key (nanoGPT's attn_dropout and resid_dropout, one rate for both).
        impl: "auto", "fused" (XLA's `jax.nn.dot_product_attention`) or "einsum"; see the module docstring.
    """

    d_model: int
    n_head: int
    n_kv_head: int | None = None
    bias: bool = True
    _: KW_ONLY  # the fields below are keyword-only, so `causal`, which has no default, can follow defaults
    causal: bool
    dropout: float = 0.0
    impl: Impl = "auto"

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        for name in ("d_model", "n_head", "n_kv_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionConfig: {name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"AttentionConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                f"pick n_head among the divisors of d_model"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"AttentionConfig: n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
                f"(each key/value head serves an equal group of query heads)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"AttentionConfig: dropout must be in [0, 1), got {self.dropout}")
        if self.impl not in ("auto", "fused", "einsum"):
            raise ValueError(f"AttentionConfig: impl must be 'auto', 'fused' or 'einsum', got {self.impl!r}")
        if self.impl == "fused" and self.dropout > 0:
            raise ValueError(
                "AttentionConfig: impl='fused' cannot drop attention probabilities "
                f"(jax.nn.dot_product_attention has no dropout), but dropout={self.dropout}; use impl='auto'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def qkv_width(self) -> int:
        """Output width of the fused qkv projection."""
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_kv_head


def qkv_permutation(config: AttentionConfig) -> np.ndarray:
    """Column indices taking the [all q | all k | all v] layout (nanoGPT's and Hugging Face's c_attn) to this
    layer's grouped layout: `w_grouped = w_split[..., perm]`, and back: `w_split = w_grouped[..., argsort(perm)]`.
    Works on the weight (d_model, qkv_width) and the bias (qkv_width,) alike."""
    n, kv, g, h = config.n_head, config.n_kv_head, config.group, config.head_dim
    q = np.arange(n * h).reshape(kv, g * h)  # query heads of group j: heads j*g .. j*g + g - 1
    k = n * h + np.arange(kv * h).reshape(kv, h)
    v = (n + kv) * h + np.arange(kv * h).reshape(kv, h)
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def init(
    key: PRNGKeyArray,
    config: AttentionConfig,
    *,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    proj_init: initializers.Initializer | None = None,
    dtype: Any = jnp.float32,
) -> Params:
    """`proj_init` overrides the output projection's initializer (GPT-2 scales it by 1/sqrt(2 * n_layer))."""
    keys, d = prandom.named_keys(key, "qkv", "proj"), config.d_model
    return {
        "qkv": linear.init(keys["qkv"], d, config.qkv_width, bias=config.bias, w_init=w_init, dtype=dtype),
        "proj": linear.init(keys["proj"], d, d, bias=config.bias, w_init=proj_init or w_init, dtype=dtype),
    }


def apply(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: AttentionConfig,
    *,
    mask: Bool[Array, "..."] | None = None,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "batch seq d_model"]:
    """Self-attention over `x`: every position attends to the positions the causal mask and `mask` allow.

    Arguments:
        mask: True where a query may attend to a key, broadcastable to (batch, n_head or 1, seq, seq). A query
            allowed to see nothing gets the plain average of all values (as jax.nn.dot_product_attention),
            not NaN. Under tensor parallelism its head axis is this device's heads or 1.
        key: switches dropout on (with `config.dropout > 0`); None is evaluation.
        axis_name: inside `shard_map`, the mesh axis the heads are split over (tensor parallelism, see the
            module docstring); `x` and the output are replicated over it. None: the params are whole.
    """
    q, k, v = qkv_heads(params, x, config, axis_name=axis_name)
    batch, seq, n_head, _ = q.shape
    allowed = combine_masks(mask, config, n_head, jnp.arange(seq), jnp.arange(seq), batch=batch)
    drop = key is not None and config.dropout > 0
    keys = prandom.named_keys(key if drop else None, "attn", "resid")
    is_causal = config.causal and mask is None  # `allowed` is then the causal mask alone
    out = attend(q, k, v, allowed, config, key=keys["attn"], axis_name=axis_name, is_causal=is_causal)
    y = linear.apply(params["proj"], out.reshape(batch, seq, -1), axis_name=axis_name)
    return dropout_lib.apply(y, rate=config.dropout, key=keys["resid"])


def qkv_heads(
    params: Params, x: Float[Array, "batch seq d_model"], config: AttentionConfig, *, axis_name: str | None = None
) -> tuple[Array, Array, Array]:
    """The fused projection split into q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim),
    all heads or this device's (tensor parallelism), after checking params and `x`. q head j*group+i reads kv head j."""
    check_keys(params, "attention", required=("qkv", "proj"))
    check_keys(params["qkv"], "attention.qkv", required=("w",), optional=("b",))
    n_kv_head = _local_kv_heads(params, x, config, axis_name)
    batch, seq, _ = x.shape
    group, head_dim = config.group, config.head_dim
    qkv = linear.apply(params["qkv"], x).reshape(batch, seq, n_kv_head, group + 2, head_dim)
    q = qkv[:, :, :, :group].reshape(batch, seq, n_kv_head * group, head_dim)
    return q, qkv[:, :, :, group], qkv[:, :, :, group + 1]


def attend(
    q: Float[Array, "batch seq n_head head_dim"],
    k: Float[Array, "batch kv_seq n_kv_head head_dim"],
    v: Float[Array, "batch kv_seq n_kv_head head_dim"],
    mask: Bool[Array, "#batch #n_head seq kv_seq"] | None,
    config: AttentionConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    is_causal: bool = False,
) -> Float[Array, "batch seq n_head head_dim"]:
    """softmax(q k^T / sqrt(head_dim), masked) v in the formulation `config.impl` picks (module docstring); with
    `key` (and `config.dropout > 0`) the probabilities are dropped. `is_causal`: `mask` is just self-attention's
    causal mask (q and k at the same positions), which cuDNN then computes itself."""
    drop = key is not None and config.dropout > 0
    if drop and axis_name is not None:
        # Each device holds other heads: their probabilities need masks of their own (not so the replicated output).
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    how = _attention_impl.pick(config.impl, q, dropout=drop, masked=mask is not None and not is_causal)
    if how == "einsum":
        return dot_product_attention(q, k, v, mask, dropout_rate=config.dropout, key=key)
    if how == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


def dot_product_attention(
    q: Float[Array, "batch seq n_head head_dim"],
    k: Float[Array, "batch kv_seq n_kv_head head_dim"],
    v: Float[Array, "batch kv_seq n_kv_head head_dim"],
    mask: Bool[Array, "#batch #n_head seq kv_seq"] | None = None,
    *,
    dropout_rate: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "batch seq n_head head_dim"]:
    """softmax(q k^T / sqrt(head_dim), masked) v, written out with einsums; the "einsum" formulation.

    `mask` is True where a query may attend to a key; its head axis is n_head or 1. Logits and softmax are
    float32 whatever the input dtype; the probabilities are dropped (with `key`, at `dropout_rate`), cast to
    the values' dtype and applied. Query heads are grouped onto key/value heads without copying k and v.
    """
    batch, seq, n_head, head_dim = q.shape
    n_kv_head = k.shape[2]
    group = n_head // n_kv_head
    q = q.reshape(batch, seq, n_kv_head, group, head_dim)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * (1.0 / head_dim**0.5)
    if mask is not None:
        if mask.shape[1] == 1:
            grouped = mask[:, :, None]
        else:
            grouped = mask.reshape(mask.shape[0], n_kv_head, group, *mask.shape[2:])
        logits = jnp.where(grouped, logits, MASKED_LOGIT)
    probs = dropout_lib.apply(jax.nn.softmax(logits, axis=-1), rate=dropout_rate, key=key)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, n_head, head_dim)


def _local_kv_heads(params: Params, x: Array, config: AttentionConfig, axis_name: str | None) -> int:
    """The number of key/value heads these params hold (all of them, or this device's share), after checking
    `x` and the weights' shapes against the config and the size of `axis_name`."""
    if x.ndim != 3 or x.shape[-1] != config.d_model:
        raise ValueError(
            f"attention: x has shape {tuple(x.shape)}, expected (batch, seq, d_model={config.d_model}) "
            f"from config {config}"
        )
    shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    if config.n_kv_head % shards:
        raise ValueError(
            f"attention: n_kv_head={config.n_kv_head} key/value heads cannot be split over the {shards} devices of "
            f"mesh axis {axis_name!r}; tensor parallelism needs n_kv_head divisible by its size"
        )
    d = config.d_model
    where = "" if axis_name is None else f" on each of the {shards} devices of mesh axis {axis_name!r}"
    want = {"qkv": (d, config.qkv_width // shards), "proj": (config.n_head * config.head_dim // shards, d)}
    for name, what in (("qkv", "(n_head + 2 * n_kv_head) * head_dim outputs"), ("proj", "n_head * head_dim inputs")):
        got = tuple(params[name]["w"].shape)
        if got != want[name]:
            raise ValueError(
                f"attention: params['{name}']['w'] has shape {got}, but config {config} needs {want[name]} "
                f"({what}){where}; were the params made with another config (or sharded another way)?"
            )
    return config.n_kv_head // shards
