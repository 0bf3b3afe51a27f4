"""Losses, computed in float32 whatever the compute dtype (a bf16 log-softmax over a large vocabulary loses
most of its precision), and returning float32."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer


def _f32(x: Array) -> Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def cross_entropy(
    logits: Float[ArrayLike, "*batch classes"], labels: Integer[ArrayLike, "*batch"], *, ignore_index: int | None = None
) -> Float[Array, "*batch"]:
    """Per-example -log softmax(logits)[label], as `optax.softmax_cross_entropy_with_integer_labels`.

    Labels equal to `ignore_index` (e.g. -1 for padding, torch's `ignore_index`) give a loss of 0; average with
    `masked_mean(loss, labels != ignore_index)` so they do not count."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need labels of shape {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    log_probs = jax.nn.log_softmax(_f32(logits), axis=-1)
    valid = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    safe = jnp.where(valid, labels, 0)
    nll = -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    return jnp.where(valid, nll, 0.0)


def masked_mean(x: Float[ArrayLike, "*batch"], mask: Array) -> Float[Array, ""]:
    """Mean of `x` over the positions where `mask` is true (0 if none is)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(_f32(x) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def mean_squared_error(pred: Float[ArrayLike, "*shape"], target: Float[ArrayLike, "*shape"]) -> Float[Array, ""]:
    """mean((pred - target)^2) over every element, in float32."""
    if pred.shape != target.shape:
        raise ValueError(f"mean_squared_error: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    return jnp.mean(jnp.square(_f32(pred) - _f32(target)))


def accuracy(logits: Float[ArrayLike, "*batch classes"], labels: Integer[ArrayLike, "*batch"]) -> Float[Array, ""]:
    """Fraction of examples whose arg-max logit is the label."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
