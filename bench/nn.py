"""Does the framework cost anything? Forward+backward of models built from purejax.nn against the same
computation written directly in jax.numpy, in one run.

    python -m bench.nn [--repeats 7] [--iters 50]

Two models: the MLP classifier (models/mlp.py) and one pre-LayerNorm transformer block (layer_norm,
attention, mlp). For each, the table gives the median time of a jitted value-and-grad step for purejax and
for raw JAX, measured interleaved (A, B, A, B, ...) so machine noise hits both alike, their ratio, and
whether XLA compiled the two into the same program (same instruction counts by opcode): when it did, any
time difference is noise, not framework cost.
"""

import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import interleaved_medians
from models import mlp
from purejax import random as prandom
from purejax.nn import attention, layer_norm
from purejax.nn import mlp as mlp_layer

# ---------------------------------------------------------------- the MLP, both ways

MLP_CONFIG = mlp.MLPConfig(d_in=784, hidden=(1024, 1024), n_classes=10)


def purejax_mlp_loss(params, x, y):
    return mlp.loss(params, (x, y), MLP_CONFIG)


def raw_mlp_loss(params, x, y):
    h = x
    for name in ("hidden_0", "hidden_1"):
        h = jnp.maximum(h @ params[name]["w"] + params[name]["b"], 0)
    logits = h @ params["head"]["w"] + params["head"]["b"]
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=-1))


# ---------------------------------------------------------------- a transformer block, both ways

ATTN = attention.AttentionConfig(d_model=384, n_head=6, bias=True, causal=True)


def init_block(key):
    keys = prandom.named_keys(key, "ln_1", "attn", "ln_2", "mlp")
    d = ATTN.d_model
    return {
        "ln_1": layer_norm.init(keys["ln_1"], d),
        "attn": attention.init(keys["attn"], ATTN),
        "ln_2": layer_norm.init(keys["ln_2"], d),
        "mlp": mlp_layer.init(keys["mlp"], d, 4 * d),
    }


def purejax_block_loss(params, x):
    x = x + attention.apply(params["attn"], layer_norm.apply(params["ln_1"], x), ATTN)
    x = x + mlp_layer.apply(params["mlp"], layer_norm.apply(params["ln_2"], x))
    return jnp.mean(jnp.square(x))


def _raw_layer_norm(p, x, eps=1e-5):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def raw_block_loss(params, x):
    b, t, d = x.shape
    h = ATTN.n_head
    qkv = _raw_layer_norm(params["ln_1"], x) @ params["attn"]["qkv"]["w"] + params["attn"]["qkv"]["b"]
    qkv = qkv.reshape(b, t, h, 3, d // h)  # purejax's column order: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
    att = jax.nn.dot_product_attention(q, k, v, mask=causal).reshape(b, t, d)
    x = x + (att @ params["attn"]["proj"]["w"] + params["attn"]["proj"]["b"])
    m = params["mlp"]
    hidden = jax.nn.gelu(_raw_layer_norm(params["ln_2"], x) @ m["fc"]["w"] + m["fc"]["b"], approximate=False)
    x = x + (hidden @ m["proj"]["w"] + m["proj"]["b"])
    return jnp.mean(jnp.square(x))


# ---------------------------------------------------------------- timing


def opcode_counts(fn, *args) -> collections.Counter:
    """Instruction counts by opcode in XLA's optimised program for `fn(*args)`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return collections.Counter(re.findall(r"=\s*\S+\s+([a-z][a-z0-9-]*)\(", text))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    mlp_params = mlp.init(jax.random.key(0), MLP_CONFIG)
    mlp_args = (
        mlp_params,
        jnp.asarray(rng.normal(size=(128, 784)), jnp.float32),
        jnp.asarray(rng.integers(0, 10, 128)),
    )
    block_args = (init_block(jax.random.key(1)), jnp.asarray(rng.normal(size=(8, 128, 384)), jnp.float32))

    cases = [
        ("MLP 784-1024-1024-10, batch 128", purejax_mlp_loss, raw_mlp_loss, mlp_args),
        ("transformer block d384 h6, batch 8x128", purejax_block_loss, raw_block_loss, block_args),
    ]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.repeats} repeats x {args.iters} iters")
    print(f"{'forward+backward':42s} {'purejax':>10s} {'raw JAX':>10s} {'ratio':>7s}  same program")
    for name, ours, raw, case_args in cases:
        grad_ours, grad_raw = jax.value_and_grad(ours), jax.value_and_grad(raw)
        np.testing.assert_allclose(grad_ours(*case_args)[0], grad_raw(*case_args)[0], rtol=1e-5)
        t_ours, t_raw = interleaved_medians(
            [jax.jit(grad_ours), jax.jit(grad_raw)], case_args, args.repeats, args.iters
        )
        same = opcode_counts(grad_ours, *case_args) == opcode_counts(grad_raw, *case_args)
        print(f"{name:42s} {t_ours * 1e3:8.3f}ms {t_raw * 1e3:8.3f}ms {t_ours / t_raw:7.3f}  {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
