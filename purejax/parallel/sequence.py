r"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"): under tensor parallelism, the parts of a block that are not split over the model axis
(LayerNorm, dropout, the residual adds) run on this device's slice of the sequence instead of on the whole of it.

Tensor parallelism alone keeps the residual stream whole on every device of the model axis: each block's
attention and MLP end with an all-reduce (`psum`) of their row-parallel output, and the LayerNorms, dropouts
and residual adds between them are repeated on every device. Sequence parallelism splits that stream over the
same axis along the sequence, and trades each collective for two halves of it:

    tokens [0, t/n) on device 0, [t/n, 2t/n) on device 1, ...      x (batch, t/n, d) between the regions
      LayerNorm  -> all-gather the sequence (`gather`)               h (batch, t, d): whole, on every device
      column-parallel qkv or fc, attention or GELU, row-parallel proj    partial sums of (batch, t, d)
      reduce-scatter over the sequence (`scatter`) -> + bias -> dropout -> + x     (batch, t/n, d)

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved are the same as tensor
parallelism's; what changes is that the activations the backward pass keeps from the LayerNorms, dropouts and
residual adds are 1/n as large, and that work is not repeated n times. `jax.grad` turns each all-gather into a
reduce-scatter and back.

Dropout on a slice keeps the masks of the whole sequence: `local_dropout` draws the mask of the whole
(batch, t, d) from the same key, as one device would, and keeps this device's slice, so the model computes
what tensor parallelism without it computes, mask for mask. The parameters outside the tensor-parallel
regions (LayerNorms, row-parallel biases, position embeddings) are replicated and now see only this device's
tokens: their gradients are summed over the model axis by the `psum` that `jax.grad` makes of their use on
varying data (`check_vma`), d numbers each.

Everything here runs inside `jax.shard_map` with the sequence on axis 1 of (batch, seq, ...) arrays.
models/gpt_parallel.py assembles a GPT from these pieces; docs/parallel-sequence.md draws it.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, Shaped

from purejax import random as prandom
from purejax.nn import attention as attention_lib
from purejax.nn import dropout as dropout_lib
from purejax.nn import linear

Params = dict[str, Any]


def gather(x: Float[Array, "batch t_local *rest"], axis_name: str) -> Float[Array, "batch seq *rest"]:
    """The whole sequence on every device of `axis_name`: its slices concatenated in device order."""
    return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def scatter(x: Float[Array, "batch seq *rest"], axis_name: str) -> Float[Array, "batch t_local *rest"]:
    """This device's slice of the sequence of the sum over `axis_name` of `x` (partial sums, one per device)."""
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=1, tiled=True)


def local_slice(x: Shaped[Array, "..."], axis_name: str, *, axis: int = 1) -> Shaped[Array, "..."]:
    """This device's slice of `x` along `axis` (the sequence): the i-th of n equal parts on device i of
    `axis_name`. No communication: `x` is whole on every device."""
    n = jax.lax.axis_size(axis_name)
    size = x.shape[axis] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * size, size, axis=axis)


def local_dropout(
    x: Float[Array, "batch t_local *rest"], *, rate: float, key: PRNGKeyArray | None, axis_name: str
) -> Float[Array, "batch t_local *rest"]:
    """`purejax.nn.dropout.apply` on this device's slice of the sequence, with this slice of the mask one
    device draws for the whole sequence from `key` (which must be the same on every device of `axis_name`)."""
    if key is None or rate == 0.0:
        return x
    whole = (x.shape[0], x.shape[1] * jax.lax.axis_size(axis_name), *x.shape[2:])
    keep = local_slice(dropout_lib.keep_mask(key, rate, whole), axis_name)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def row_parallel(
    params: Params, x: Float[Array, "batch seq d_in_local"], axis_name: str
) -> Float[Array, "batch t_local d_out"]:
    """A row-parallel linear layer (this device's rows of w) ending in a reduce-scatter over the sequence where
    `purejax.nn.linear.apply` ends in a psum; the replicated bias is added once, after it."""
    y = scatter(linear.apply({"w": params["w"]}, x), axis_name)
    return y + params["b"] if "b" in params else y


def attention(
    params: Params,
    x: Float[Array, "batch t_local d_model"],
    config: attention_lib.AttentionConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str,
) -> Float[Array, "batch t_local d_model"]:
    """`purejax.nn.attention.apply` (causal or not, no extra mask) on this device's heads, from and to this
    device's slice of the sequence: all-gather, attention, reduce-scatter. The dropout keys are split as
    there, so the masks are tensor parallelism's."""
    q, k, v = attention_lib.qkv_heads(params, gather(x, axis_name), config, axis_name=axis_name)
    batch, seq, n_head, _ = q.shape
    allowed = attention_lib.combine_masks(None, config, n_head, jnp.arange(seq), jnp.arange(seq), batch=batch)
    drop = key is not None and config.dropout > 0
    keys = prandom.named_keys(key if drop else None, "attn", "resid")
    out = attention_lib.attend(q, k, v, allowed, config, key=keys["attn"], axis_name=axis_name, is_causal=config.causal)
    y = row_parallel(params["proj"], out.reshape(batch, seq, -1), axis_name)
    return local_dropout(y, rate=config.dropout, key=keys["resid"], axis_name=axis_name)


def mlp(
    params: Params,
    x: Float[Array, "batch t_local d_model"],
    *,
    activation: Callable[[Array], Array],
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    axis_name: str,
) -> Float[Array, "batch t_local d_model"]:
    """`purejax.nn.mlp.apply` on this device's hidden units, from and to this device's slice of the sequence."""
    h = activation(linear.apply(params["fc"], gather(x, axis_name)))  # column-parallel: no communication
    return local_dropout(row_parallel(params["proj"], h, axis_name), rate=dropout, key=key, axis_name=axis_name)


def check_length(seq: int, axis_name: str) -> None:
    """Raise unless a sequence of `seq` tokens splits evenly over the devices of `axis_name` (at trace time)."""
    n = jax.lax.axis_size(axis_name)
    if seq % n:
        raise ValueError(
            f"sequence parallelism: a sequence of {seq} tokens cannot be split evenly over the {n} devices of "
            f"tensor-parallel axis {axis_name!r}; use a length divisible by {n} (block_size divisible by tp)"
        )
