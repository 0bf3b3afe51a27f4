"""The training step every contender of bench/gpt_train.py follows: nanoGPT's optimizer settings and schedule
(written by hand for the peers that schedule themselves, and in optax), the JAX peers' attention call, the
cross-entropy with its softmax in float32, and the cast of the weights to the compute dtype.

One place for these, so that the peers cannot drift apart: what differs between the contenders is how each
framework holds the model and the optimizer state, not the maths.
"""

import jax
import jax.numpy as jnp
import numpy as np

from train import gpt as train_gpt

TRAIN = train_gpt.GPTSettings()  # the optimizer settings of `python -m train.gpt`'s defaults
GRAD_CLIP = 1.0


def nanogpt_lr(it, xp=np):
    """nanoGPT's get_lr(it) with train/gpt.py's defaults, for the peers that schedule by hand; `xp` is numpy
    (torch's Python loop) or jax.numpy (inside a jitted step)."""
    lr, min_lr, warmup, decay = TRAIN.learning_rate, TRAIN.min_lr, TRAIN.warmup_iters, TRAIN.lr_decay_iters
    ratio = xp.clip((it - warmup) / (decay - warmup), 0.0, 1.0)
    cosine = min_lr + 0.5 * (1.0 + xp.cos(np.pi * ratio)) * (lr - min_lr)
    return xp.where(it < warmup, lr * (it + 1) / (warmup + 1), cosine)


def optax_adamw():
    """The same optimizer in optax, for the NNX, Equinox and Haiku peers: clip, then AdamW with the same schedule
    (optax's warmup starts at init_value; lr / (warmup + 1) makes it nanoGPT's) and the ndim >= 2 decay rule."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        TRAIN.learning_rate / (TRAIN.warmup_iters + 1),
        TRAIN.learning_rate,
        TRAIN.warmup_iters,
        TRAIN.lr_decay_iters,
        TRAIN.min_lr,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(GRAD_CLIP),
        optax.adamw(schedule, b1=TRAIN.beta1, b2=TRAIN.beta2, weight_decay=TRAIN.weight_decay, mask=decay_mask),
    )


def causal_attention(q, k, v):
    """The JAX peers' attention: `jax.nn.dot_product_attention`, asking for cuDNN's flash attention on a GPU in
    bfloat16/float16 (what purejax's attention_impl="auto" does there), XLA's otherwise."""
    cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn" if cudnn else None)


def to_compute(tree, dtype):
    """The floating arrays of `tree` in the compute dtype (the peers' mixed precision: float32 weights kept)."""
    floating = lambda a: hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)  # noqa: E731
    return jax.tree.map(lambda a: a.astype(dtype) if floating(a) else a, tree)


def xent(logits, y):
    """Mean cross-entropy, the softmax in float32 whatever the logits' dtype (as purejax's loss)."""
    logits = logits.astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1).mean()
