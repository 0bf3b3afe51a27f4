"""The `raw` and `raw-scan` peers of bench/gpt_train.py: the GPT and its training step in jax.numpy alone.

The params are a plain dict (`raw_weights`), the blocks a list of per-layer dicts run as a Python loop (`raw`) or
one dict stacked over a leading layer axis run under `lax.scan` (`raw-scan`); AdamW with global-norm clipping and
nanoGPT's learning-rate schedule is written out by hand, and the step is one `jax.jit` with its state donated.
"""

from functools import partial

import jax
import jax.numpy as jnp

from bench.gpt_train_recipe import GRAD_CLIP, TRAIN, causal_attention, nanogpt_lr, to_compute, xent
from bench.gpt_train_weights import raw_weights


def raw_layer_norm(p, x):
    """LayerNorm, its statistics in float32 whatever the compute dtype (as purejax's)."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    y = ((h - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * p["w"]
    return y + p["b"] if "b" in p else y


def raw_linear(p, x):
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def raw_block(p, x, n_head):
    b, t, d = x.shape
    q, k, v = jnp.split(raw_linear(p["qkv"], raw_layer_norm(p["ln_1"], x)), 3, axis=-1)
    heads = lambda a: a.reshape(b, t, n_head, d // n_head)  # noqa: E731
    x = x + raw_linear(p["attn_proj"], causal_attention(heads(q), heads(k), heads(v)).reshape(b, t, d))
    h = jax.nn.gelu(raw_linear(p["fc"], raw_layer_norm(p["ln_2"], x)), approximate=False)
    return x + raw_linear(p["mlp_proj"], h)


def raw_loss(params, x, y, n_head, stacked, dtype="float32"):
    params = to_compute(params, dtype)
    h = params["wte"][x] + params["wpe"][: x.shape[1]]
    if stacked:
        h, _ = jax.lax.scan(lambda h, p: (raw_block(p, h, n_head), None), h, params["blocks"])
    else:
        for p in params["blocks"]:
            h = raw_block(p, h, n_head)
    return xent(raw_layer_norm(params["ln_f"], h) @ params["wte"].T, y)


def raw_train_step(state, x, y, n_head, stacked, dtype="float32"):
    """value_and_grad, clip to global norm 1, AdamW with decay on ndim >= 2 (per layer), nanoGPT's lr."""
    params, mu, nu, it = state
    loss, grads = jax.value_and_grad(raw_loss)(params, x, y, n_head, stacked, dtype)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    clip = jnp.minimum(1.0, GRAD_CLIP / norm)
    b1, b2, lr, t = TRAIN.beta1, TRAIN.beta2, nanogpt_lr(it, jnp), it + 1
    decays = jax.tree.map(lambda p: p.ndim >= 2, params)  # not the biases and LayerNorm weights
    if stacked:  # stacked block leaves have a leading layer axis
        decays["blocks"] = jax.tree.map(lambda p: p.ndim >= 3, params["blocks"])
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * clip * g, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(clip * g), nu, grads)

    def update(p, m, v, decay):
        u = (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + 1e-8)
        return p - lr * (u + TRAIN.weight_decay * p if decay else u)

    params = jax.tree.map(update, params, mu, nu, decays)
    return (params, mu, nu, it + 1), loss


def make_raw(weights, config, x, y, stacked=False, dtype="float32"):
    params = jax.tree.map(jnp.array, raw_weights(weights, config, stacked))
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
    state = (params, zeros(), zeros(), jnp.zeros((), jnp.int32))  # params, Adam's mu and nu, steps taken
    step_fn = jax.jit(partial(raw_train_step, n_head=config.n_head, stacked=stacked, dtype=dtype), donate_argnums=0)
    x, y = jnp.asarray(x), jnp.asarray(y)

    def step():
        nonlocal state
        state, loss = step_fn(state, x, y)
        return loss

    return step
