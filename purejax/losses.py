"""Losses, computed in float32 whatever the compute dtype (a bf16 log-softmax over a large vocabulary loses
most of its precision), and returning float32."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer


def _f32(x: Array) -> Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def cross_entropy(
    logits: Float[ArrayLike, "*batch classes"],
    labels: Integer[ArrayLike, "*batch"],
    *,
    ignore_index: int | None = None,
    axis_name: str | None = None,
) -> Float[Array, "*batch"]:
    """Per-example -log softmax(logits)[label], as `optax.softmax_cross_entropy_with_integer_labels`.

    Labels equal to `ignore_index` (e.g. -1 for padding, torch's `ignore_index`) give a loss of 0; average with
    `masked_mean(loss, labels != ignore_index)` so they do not count. Any other label outside the classes gives
    NaN, so a data bug shows in the loss instead of training on a wrong target.

    Vocab-parallel (Megatron-LM's cross-entropy): with `axis_name`, inside `shard_map`, `logits` is this
    device's slice of the classes (device i of n holds classes [i * C, (i + 1) * C), C = logits.shape[-1]) and
    the full logits are never gathered: the row maximum is `pmax`-ed (of a stop_gradient: it only keeps exp
    in range and pmax has no derivative), the sum of exponentials and the label's logit are `psum`-med,
    three scalars per example instead of the whole vocabulary."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} need labels of shape {tuple(logits.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    logits, labels = _f32(logits), jnp.asarray(labels)
    valid = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    n_classes = logits.shape[-1]
    total = n_classes if axis_name is None else n_classes * jax.lax.axis_size(axis_name)
    out_of_range = valid & ((labels < 0) | (labels >= total))  # NaN, never a silently wrong loss
    if axis_name is None:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(log_probs, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
        return jnp.where(out_of_range, jnp.nan, jnp.where(valid, nll, 0.0))
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)
    shifted = logits - top[..., None]
    sum_exp = jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=-1), axis_name)
    local = labels - jax.lax.axis_index(axis_name) * n_classes
    mine = valid & (local >= 0) & (local < n_classes)
    label_logit = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    label_logit = jax.lax.psum(jnp.where(mine, label_logit, 0.0), axis_name)
    return jnp.where(out_of_range, jnp.nan, jnp.where(valid, jnp.log(sum_exp) - label_logit, 0.0))


def masked_mean(x: Float[ArrayLike, "*batch"], mask: Array, *, axis_name: str | None = None) -> Float[Array, ""]:
    """Mean of `x` over the positions where `mask` is true (0 if none is).

    With `axis_name` (data parallelism, inside `shard_map`), the mean over the positions of every shard: the
    sum and the count are `psum`-med over the axis before dividing, so shards with more masked positions
    weigh less, exactly as one device holding the whole batch. Differentiating this mean gives the whole
    batch's gradient on every device, with no further averaging (purejax/parallel/step.py says why)."""
    mask = mask.astype(jnp.float32)
    total, count = jnp.sum(_f32(x) * mask), jnp.sum(mask)
    if axis_name is not None:
        total, count = jax.lax.psum((total, count), axis_name)
    return total / jnp.maximum(count, 1.0)


def mean_squared_error(pred: Float[ArrayLike, "*shape"], target: Float[ArrayLike, "*shape"]) -> Float[Array, ""]:
    """mean((pred - target)^2) over every element, in float32."""
    if pred.shape != target.shape:
        raise ValueError(f"mean_squared_error: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    return jnp.mean(jnp.square(_f32(pred) - _f32(target)))


def accuracy(logits: Float[ArrayLike, "*batch classes"], labels: Integer[ArrayLike, "*batch"]) -> Float[Array, ""]:
    """Fraction of examples whose arg-max logit is the label."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
