"""A pre-LayerNorm transformer encoder block (ViT's, Dosovitskiy et al. 2021; BERT's order of sublayers with
the norms moved in front of them, Xiong et al. 2020):

    x = x + attn(ln_1(x))      every position attends to every real position: no causal mask
    x = x + mlp(ln_2(x))       linear to d_ff, GELU, linear back

params: {"ln_1": layer_norm, "attn": attention {"qkv", "proj"}, "ln_2": layer_norm, "mlp": mlp {"fc", "proj"}},
the names of the GPT's block (models/gpt.py), which is the same block with a causal mask.

Non-causal by construction: the config has no `causal` field, and builds its attention with `causal=False`.
Padding is a `kv_mask`, (batch, seq) and True at the real tokens: no position attends to a padded one, so the
outputs at the real positions do not depend on what the padding holds (the padded positions' own outputs are
computed like the others and mean nothing).
"""

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import activations, attention, initializers, layer_norm, mlp
from purejax.nn._check import check_keys
from purejax.nn.cross_attention import check_kv_mask

Params = dict[str, Any]


@dataclass(frozen=True)
class EncoderBlockConfig:
    """Static description of an encoder block; frozen and hashable, so it can be a static jit argument.

    Arguments:
        d_model: width of the input and the output.
        n_head: number of attention heads; must divide d_model.
        d_ff: hidden width of the MLP; None means 4 * d_model (the Transformer's and ViT's ratio).
        bias: whether the linear layers and the LayerNorms have biases.
        dropout: rate for the attention probabilities, the attention's output and the MLP's output, applied
            only when `apply` gets a key.
        impl: the attention's formulation, "auto", "fused" or "einsum" (`AttentionConfig.impl`).
    """

    d_model: int
    n_head: int
    d_ff: int | None = None
    bias: bool = True
    dropout: float = 0.0
    impl: attention.Impl = "auto"

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff <= 0:
            raise ValueError(f"EncoderBlockConfig: d_ff must be a positive int, got {self.d_ff!r}")
        self.attention  # noqa: B018 - builds the AttentionConfig, so its errors (n_head, dropout, impl) surface here

    @property
    def attention(self) -> attention.AttentionConfig:
        """The block's self-attention: never causal, an encoder sees the whole sequence."""
        settings = dict(bias=self.bias, dropout=self.dropout, impl=self.impl)
        return attention.AttentionConfig(d_model=self.d_model, n_head=self.n_head, causal=False, **settings)


def init(
    key: PRNGKeyArray,
    config: EncoderBlockConfig,
    *,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    proj_init: initializers.Initializer | None = None,
    dtype: Any = jnp.float32,
) -> Params:
    """LayerNorms the identity; the attention's and the MLP's weights from `w_init`, and the two projections
    that write into the residual stream (attn.proj, mlp.proj) from `proj_init` when given."""
    keys, d = prandom.named_keys(key, "ln_1", "attn", "ln_2", "mlp"), config.d_model
    return {
        "ln_1": layer_norm.init(keys["ln_1"], d, bias=config.bias, dtype=dtype),
        "attn": attention.init(keys["attn"], config.attention, w_init=w_init, proj_init=proj_init, dtype=dtype),
        "ln_2": layer_norm.init(keys["ln_2"], d, bias=config.bias, dtype=dtype),
        "mlp": mlp.init(keys["mlp"], d, config.d_ff, bias=config.bias, w_init=w_init, proj_init=proj_init, dtype=dtype),
    }


def apply(
    params: Params,
    x: Float[ArrayLike, "batch seq d_model"],
    config: EncoderBlockConfig,
    *,
    kv_mask: Bool[ArrayLike, "batch seq"] | None = None,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "batch seq d_model"]:
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    Arguments:
        kv_mask: True at the real tokens, False at padding; no position attends to a padded one.
        key: switches dropout on (with `config.dropout > 0`); None is evaluation.
    """
    x = jnp.asarray(x)
    check_keys(params, "encoder_block", required=("ln_1", "attn", "ln_2", "mlp"))
    batch, seq = x.shape[0], x.shape[1]
    mask = None
    if kv_mask is not None:  # the same keys hidden from every query and every head
        kv_mask = check_kv_mask("encoder_block", kv_mask, batch, seq, "x", x)
        mask = jnp.broadcast_to(kv_mask[:, None, None, :], (batch, 1, seq, seq))
    keys = prandom.named_keys(key, "attn", "mlp")  # all None in evaluation
    h = layer_norm.apply(params["ln_1"], x)
    x = x + attention.apply(params["attn"], h, config.attention, mask=mask, key=keys["attn"])
    h = layer_norm.apply(params["ln_2"], x)
    return x + mlp.apply(params["mlp"], h, activation=activations.gelu, dropout=config.dropout, key=keys["mlp"])
