"""One GPT training step, purejax against the same model in raw JAX, Flax NNX, Equinox, Haiku and PyTorch.

    python -m bench.gpt_train [--configs tiny,baby,small] [--bias false|true|both] [--repeats N] [--peers ...]
    python -m bench.gpt_train --configs gpt2       # GPT-2 124M on a GPU: bfloat16, MFU against the chip's peak

The step is nanoGPT's: forward, backward, global-norm gradient clipping at 1.0, then AdamW (betas 0.9/0.99,
weight decay 0.1 on tensors with ndim >= 2 only, warmup + cosine learning rate), no dropout, in `--dtype`
("auto": float32 on a CPU, bfloat16 compute with float32 weights and optimizer state on a GPU or TPU), on
nanoGPT's architecture (learned positions, pre-LayerNorm blocks, fused qkv causal attention, 4x MLP with exact
GELU, final LayerNorm, weight-tied head), without biases (nanoGPT's bias=False) or, `--bias true` (configs
labelled "tiny-bias", ...), with GPT-2's biases in every linear layer and LayerNorm; `--bias both` runs each
config both ways. Every contender is built from the SAME initial weights (purejax's `gpt.init`, its LayerNorm
scales and all biases then moved off their 1 and 0 by a fixed random draw, `initial_weights`, so that a peer
that dropped one would not agree; copied into each framework's modules) and fed the same batch, so before any
timing the run checks that all of them report the same loss on the first step (the initial weights) and on
the second (after one identical update).

Contenders (`--peers`, default all but raw-scan):
    purejax        purejax/models/gpt.py + purejax.optim, built exactly as purejax/train/gpt.py builds its step,
                   with GPTConfig's default `layers` (what a user gets)
    purejax-scan   the same with GPTConfig(layers="scan"): the blocks under lax.scan
    purejax-loop   the same with GPTConfig(layers="loop"): the blocks unrolled as a Python loop
    raw            jax.numpy only: a dict of params with a list of per-layer dicts, a hand-written AdamW
    raw-scan       the same maths with the blocks stacked and run under lax.scan
    nnx            Flax NNX modules, optax AdamW + clipping, `nnx.jit` (graph mode, the default)
    nnx-tree       the same with `graph=False` (NNX's tree mode: Modules handled as plain pytrees)
    nnx-split      the same model, `nnx.split` once, then a functional `jax.jit` step that merges inside
    equinox        eqx.Module GPT (one sequence at a time, vmapped over the batch), optax, `eqx.filter_jit`
    haiku          dm-haiku modules (hk.transform, a Python loop over blocks), optax, `jax.jit` with the
                   params and optimizer state donated (bench/gpt_train_haiku.py)
    torch          PyTorch eager (torch.set_num_threads(2)), torch.optim.AdamW defaults (fused on CUDA),
                   clip_grad_norm_; on the GPU when JAX runs on one, bfloat16 under torch.autocast
    torch-compile  the same with the model under torch.compile (the optimizer step stays eager)

In bfloat16 every contender computes in bfloat16 and keeps float32 weights and optimizer state; the JAX peers
ask `jax.nn.dot_product_attention` for cuDNN on a GPU (`causal_attention`) as purejax's "auto" does.

For each config and contender: the median step time (interleaved samples, bench/timing.py), tokens/s, the
time relative to purejax's, and MFU (nanoGPT's FLOPs-per-token estimate) as a fraction of the accelerator's
dense bfloat16 peak (`purejax.train.run.PEAK_BF16_FLOPS`, by device kind) or, on a CPU, of this machine's
measured float32 matmul rate (`purejax.train.run.measure_matmul_flops`). "first s" is the first call:
tracing and compilation included. A markdown table is printed at the end.
"""

import argparse
import dataclasses
import math
import os
import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

# libgomp's default ACTIVE wait makes torch's 2 OpenMP threads spin at every barrier; on a shared 2-core machine,
# whenever another process holds a core, a tiny-config torch step then takes 50-700 ms instead of about 5.
# PASSIVE (threads sleep at barriers) avoids that. Set before torch loads libgomp; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# On a GPU, JAX would take 75% of its memory at the first op, leaving torch's peers too little: allocate on demand.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bench.timing import interleaved_medians
from purejax import optim
from purejax.models import gpt, gpt_hf
from purejax.precision import Policy, resolve_compute_dtype
from purejax.train import gpt as train_gpt
from purejax.train import run

TRAIN = train_gpt.TrainConfig()  # the optimizer settings of `python -m purejax.train.gpt`'s defaults
GRAD_CLIP = 1.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark configuration: the model, the batch size, and how long to sample."""

    model: gpt.GPTConfig
    batch: int
    repeats: int  # default number of interleaved samples
    sample_seconds: float | None  # per sample; None: one step per sample


def _config(n_layer, n_head, n_embd, block_size, vocab_size=65) -> gpt.GPTConfig:
    """A case's model: nanoGPT's bias=False, `layers` left at GPTConfig's default (the `purejax` contender's)."""
    return gpt.GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd, dropout=0.0, bias=False)  # fmt: skip


SMALL = _config(6, 6, 384, 256)  # shakespeare-char's shape (nanoGPT's config/train_shakespeare_char.py)
CASES = {
    "tiny": Case(_config(2, 2, 32, 32), batch=8, repeats=9, sample_seconds=0.1),  # dispatch-bound
    "baby": Case(_config(4, 4, 128, 64), batch=12, repeats=7, sample_seconds=0.25),  # nanoGPT's CPU config
    "small": Case(SMALL, batch=4, repeats=3, sample_seconds=None),
    "small-b16": Case(SMALL, batch=16, repeats=3, sample_seconds=None),
    # GPT-2 124M (GPT-2's vocabulary padded to 50304, nanoGPT's; no biases): for a GPU
    "gpt2": Case(_config(12, 12, 768, 1024, vocab_size=50304), batch=16, repeats=5, sample_seconds=1.0),
}
PEERS = ("purejax", "purejax-scan", "purejax-loop", "raw", "raw-scan", "nnx", "nnx-tree", "nnx-split", "equinox",
         "haiku", "torch", "torch-compile")  # fmt: skip
DEFAULT_PEERS = tuple(p for p in PEERS if p != "raw-scan")  # raw-scan on request: it keeps the run shorter
BIAS_SUFFIX = "-bias"


def cases(configs: list[str], bias: str) -> dict[str, Case]:
    """The runs `--configs` and `--bias` ask for, by label: each config without biases ("tiny"), with GPT-2's
    biases ("tiny-bias"), or both in that order."""
    if bias not in ("false", "true", "both"):
        raise ValueError(f"bias must be false, true or both, got {bias!r}")
    out = {}
    for name in configs:
        if bias != "true":
            out[name] = CASES[name]
        if bias != "false":
            case = CASES[name]
            out[name + BIAS_SUFFIX] = dataclasses.replace(case, model=dataclasses.replace(case.model, bias=True))
    return out


def nanogpt_lr(it, xp=np):
    """nanoGPT's get_lr(it) with purejax/train/gpt.py's defaults, for the peers that schedule by hand; `xp` is numpy
    (torch's Python loop) or jax.numpy (inside a jitted step)."""
    lr, min_lr, warmup, decay = TRAIN.learning_rate, TRAIN.min_lr, TRAIN.warmup_iters, TRAIN.lr_decay_iters
    ratio = xp.clip((it - warmup) / (decay - warmup), 0.0, 1.0)
    cosine = min_lr + 0.5 * (1.0 + xp.cos(np.pi * ratio)) * (lr - min_lr)
    return xp.where(it < warmup, lr * (it + 1) / (warmup + 1), cosine)


def optax_adamw():
    """The same optimizer in optax, for the NNX and Equinox peers: clip, then AdamW with the same schedule
    (optax's warmup starts at init_value; lr / (warmup + 1) makes it nanoGPT's) and the ndim >= 2 decay rule."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(TRAIN.learning_rate / (TRAIN.warmup_iters + 1), TRAIN.learning_rate,
                                                  TRAIN.warmup_iters, TRAIN.lr_decay_iters, TRAIN.min_lr)  # fmt: skip
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


# Every `make_*` below takes the initial weights (purejax's layout, as numpy arrays), the config and the batch
# (numpy), and `dtype`, the compute dtype, and returns `step()`: one training step on that batch, returning the
# loss before the update. The step keeps its own training state in a closure, as a training loop would.


# ---------------------------------------------------------------- purejax


def make_purejax(weights, config, x, y, layers=None, *, optimizer=None, donate=True, dtype="float32"):
    """The step of purejax/train/gpt.py: optim.train_step with make_optimizer and make_loss_fn, jitted, state donated.
    `layers` None keeps `config.layers` (the `purejax` contender: GPTConfig's default); `optimizer` and `donate`
    let bench/gpt_anatomy.py time variants of the same step."""
    model = config if layers is None else dataclasses.replace(config, layers=layers)
    optimizer = optimizer or train_gpt.make_optimizer(TRAIN)
    loss_fn = train_gpt.make_loss_fn(model, Policy(jnp.float32, dtype, jnp.float32))
    step_fn = partial(optim.train_step, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=GRAD_CLIP)
    step_fn = jax.jit(step_fn, donate_argnums=0 if donate else ())
    state = optim.init_train_state(jax.tree.map(jnp.array, weights), optimizer, jax.random.key(0))
    batch = (jnp.asarray(x), jnp.asarray(y))

    def step():
        nonlocal state
        state, metrics = step_fn(state, batch)
        return metrics["loss"]

    return step


# ---------------------------------------------------------------- raw JAX


LAYERS = ("ln_1", "qkv", "attn_proj", "ln_2", "fc", "mlp_proj")  # a block's LayerNorms and linears, in order


def as_weight_bias(params):
    """purejax's LayerNorm {"scale"[, "bias"]} or linear {"w"[, "b"]} as {"w"[, "b"]}: the weight and the
    optional bias that every peer's LayerNorm and Linear modules hold."""
    names = {"scale": "w", "bias": "b"}
    return {names.get(k, k): v for k, v in params.items()}


def raw_weights(weights, config, stacked: bool):
    """purejax's layout -> {"wte", "wpe", "ln_f", "blocks"}: every LayerNorm and linear a {"w"[, "b"]} dict
    (`as_weight_bias`; a "b" when config.bias), the blocks a list of per-layer dicts {"ln_1", "qkv", ...}
    (`LAYERS`), or (stacked) one such dict over a leading layer axis. The fused qkv columns, weight and bias, go
    from purejax's per-head grouped order to nanoGPT's [q | k | v], which every peer splits in three (the same
    conversion as for Hugging Face files)."""
    b = weights["blocks"]
    qkv = {k: gpt_hf.qkv_to_hf(np.asarray(v), config) for k, v in b["attn"]["qkv"].items()}
    ours = {"ln_1": b["ln_1"], "qkv": qkv, "attn_proj": b["attn"]["proj"], "ln_2": b["ln_2"], "fc": b["mlp"]["fc"],
            "mlp_proj": b["mlp"]["proj"]}  # fmt: skip
    blocks = {name: as_weight_bias(ours[name]) for name in LAYERS}
    if not stacked:
        blocks = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(config.n_layer)]
    return {"wte": weights["wte"]["w"], "wpe": weights["wpe"]["w"], "ln_f": as_weight_bias(weights["ln_f"]),
            "blocks": blocks}  # fmt: skip


def layers_of(model, raw):
    """(module, its raw params {"w"[, "b"]}) for the final LayerNorm and every block's LayerNorms and linears: the
    peers' modules carry the raw params' names (`model.ln_f`, `model.blocks[i].qkv`, ...), so one walk serves
    every framework's weight copy."""
    pairs = [(model.ln_f, raw["ln_f"])]
    for block, p in zip(model.blocks, raw["blocks"], strict=True):
        pairs += [(getattr(block, name), p[name]) for name in LAYERS]
    return pairs


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


# ---------------------------------------------------------------- Flax NNX


def nnx_model(weights, config, dtype="float32"):
    """Flax NNX modules computing in `dtype` with float32 params (flax's `dtype` and `param_dtype`)."""
    from flax import nnx

    kw = {"dtype": jnp.dtype(dtype), "param_dtype": jnp.float32}
    linear = partial(nnx.Linear, use_bias=config.bias, **kw)
    layer_norm = partial(nnx.LayerNorm, epsilon=1e-5, use_bias=config.bias, **kw)

    class Block(nnx.Module):
        def __init__(self, d, n_head, rngs):
            self.n_head = n_head
            self.ln_1 = layer_norm(d, rngs=rngs)
            self.qkv = linear(d, 3 * d, rngs=rngs)
            self.attn_proj = linear(d, d, rngs=rngs)
            self.ln_2 = layer_norm(d, rngs=rngs)
            self.fc = linear(d, 4 * d, rngs=rngs)
            self.mlp_proj = linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            b, t, d = x.shape
            q, k, v = (a.reshape(b, t, self.n_head, d // self.n_head) for a in jnp.split(self.qkv(self.ln_1(x)), 3, -1))
            x = x + self.attn_proj(causal_attention(q, k, v).reshape(b, t, d))
            return x + self.mlp_proj(jax.nn.gelu(self.fc(self.ln_2(x)), approximate=False))

    class GPT(nnx.Module):
        def __init__(self, c, rngs):
            self.wte = nnx.Embed(c.vocab_size, c.n_embd, rngs=rngs, **kw)
            self.wpe = nnx.Embed(c.block_size, c.n_embd, rngs=rngs, **kw)
            self.blocks = nnx.List([Block(c.n_embd, c.n_head, rngs) for _ in range(c.n_layer)])
            self.ln_f = layer_norm(c.n_embd, rngs=rngs)

        def __call__(self, idx):
            x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))

    model = GPT(config, nnx.Rngs(0))
    r = raw_weights(weights, config, stacked=False)
    model.wte.embedding[...], model.wpe.embedding[...] = jnp.array(r["wte"]), jnp.array(r["wpe"])
    for module, p in layers_of(model, r):
        weight = module.scale if isinstance(module, nnx.LayerNorm) else module.kernel  # kernels (in, out), as ours
        weight[...] = jnp.array(p["w"])
        if "b" in p:
            module.bias[...] = jnp.array(p["b"])
    return model


def xent(logits, y):
    """Mean cross-entropy, the softmax in float32 whatever the logits' dtype (as purejax's loss)."""
    logits = logits.astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1).mean()


def make_nnx(weights, config, x, y, mode="graph", dtype="float32"):
    """mode "graph": nnx.jit; "tree": nnx.jit(graph=False); "split": nnx.split once, jax.jit + nnx.merge."""
    from flax import nnx

    graph = mode != "tree"
    model = nnx_model(weights, config, dtype)
    optimizer = nnx.Optimizer(model, optax_adamw(), wrt=nnx.Param)
    x, y = jnp.asarray(x), jnp.asarray(y)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: xent(m(x), y), graph=graph)(model)
        optimizer.update(model, grads)
        return loss

    if mode == "split":
        graphdef, state = nnx.split((model, optimizer))

        @partial(jax.jit, donate_argnums=0)
        def split_step(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss = train_step(model, optimizer, x, y)
            return nnx.state((model, optimizer)), loss

        def step():
            nonlocal state
            state, loss = split_step(state, x, y)
            return loss

        return step
    jitted = nnx.jit(train_step, graph=graph)
    return lambda: jitted(model, optimizer, x, y)


# ---------------------------------------------------------------- Equinox


def equinox_model(weights, config):
    import equinox as eqx

    linear = partial(eqx.nn.Linear, use_bias=config.bias)
    layer_norm = partial(eqx.nn.LayerNorm, eps=1e-5, use_bias=config.bias)

    class Block(eqx.Module):
        ln_1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        attn_proj: eqx.nn.Linear
        ln_2: eqx.nn.LayerNorm
        fc: eqx.nn.Linear
        mlp_proj: eqx.nn.Linear
        n_head: int = eqx.field(static=True)

        def __init__(self, d, n_head, key):
            keys = jax.random.split(key, 4)
            self.n_head = n_head
            self.ln_1, self.ln_2 = layer_norm(d), layer_norm(d)
            self.qkv = linear(d, 3 * d, key=keys[0])
            self.attn_proj = linear(d, d, key=keys[1])
            self.fc = linear(d, 4 * d, key=keys[2])
            self.mlp_proj = linear(4 * d, d, key=keys[3])

        def __call__(self, x):  # one sequence (seq, d): Equinox layers act on one example
            t, d = x.shape
            qkv = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln_1)(x)), 3, -1)
            q, k, v = (a.reshape(t, self.n_head, d // self.n_head) for a in qkv)
            x = x + jax.vmap(self.attn_proj)(causal_attention(q, k, v).reshape(t, d))
            h = jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln_2)(x)), approximate=False)
            return x + jax.vmap(self.mlp_proj)(h)

    class GPT(eqx.Module):
        wte: eqx.nn.Embedding
        wpe: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm

        def __init__(self, c, key):
            keys = jax.random.split(key, c.n_layer + 2)
            self.wte = eqx.nn.Embedding(c.vocab_size, c.n_embd, key=keys[0])
            self.wpe = eqx.nn.Embedding(c.block_size, c.n_embd, key=keys[1])
            self.blocks = [Block(c.n_embd, c.n_head, k) for k in keys[2:]]
            self.ln_f = layer_norm(c.n_embd)

        def __call__(self, idx):  # one sequence of ids (seq,) -> logits (seq, vocab)
            x = self.wte.weight[idx] + self.wpe.weight[: idx.shape[0]]
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.ln_f)(x) @ self.wte.weight.T

    model = GPT(config, jax.random.key(0))
    r = raw_weights(weights, config, stacked=False)
    parts = {"weight": "w", "bias": "b"} if config.bias else {"weight": "w"}  # Equinox's names: ours (else None)

    def where(m):
        return (m.wte.weight, m.wpe.weight, *[getattr(module, a) for module, _ in layers_of(m, r) for a in parts])

    # Equinox's Linear weights are (out, in); .T leaves the 1-D LayerNorm weights and the biases as they are
    new = [r["wte"], r["wpe"], *[p[ours].T for _, p in layers_of(model, r) for ours in parts.values()]]
    return eqx.tree_at(where, model, [jnp.array(a) for a in new])


def make_equinox(weights, config, x, y, dtype="float32"):
    import equinox as eqx

    tx = optax_adamw()
    model = equinox_model(weights, config)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @partial(eqx.filter_jit, donate="all-except-first")
    def train_step(batch, model, opt_state):
        def loss_fn(model):  # in bfloat16: the model cast inside the loss, the gradients float32
            return xent(jax.vmap(to_compute(model, dtype))(batch[0]), batch[1])

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    batch = (jnp.asarray(x), jnp.asarray(y))

    def step():
        nonlocal model, opt_state
        model, opt_state, loss = train_step(batch, model, opt_state)
        return loss

    return step


# ---------------------------------------------------------------- PyTorch


def torch_model(weights, config):
    import torch
    import torch.nn.functional as F
    from torch import nn

    linear, layer_norm = partial(nn.Linear, bias=config.bias), partial(nn.LayerNorm, bias=config.bias)

    class Block(nn.Module):
        def __init__(self, d, n_head):
            super().__init__()
            self.n_head = n_head
            self.ln_1, self.ln_2 = layer_norm(d), layer_norm(d)
            self.qkv, self.attn_proj = linear(d, 3 * d), linear(d, d)
            self.fc, self.mlp_proj = linear(d, 4 * d), linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            qkv = self.qkv(self.ln_1(x)).split(d, 2)
            q, k, v = (a.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for a in qkv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
            self.blocks = nn.ModuleList([Block(c.n_embd, c.n_head) for _ in range(c.n_layer)])
            self.ln_f = layer_norm(c.n_embd)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT(config)
    r = raw_weights(weights, config, stacked=False)
    with torch.no_grad():
        model.wte.weight.copy_(torch.from_numpy(np.array(r["wte"])))
        model.wpe.weight.copy_(torch.from_numpy(np.array(r["wpe"])))
        for module, p in layers_of(model, r):
            module.weight.copy_(torch.from_numpy(np.array(p["w"].T)))  # torch's Linear is (out, in)
            if "b" in p:
                module.bias.copy_(torch.from_numpy(np.array(p["b"])))
    return model


def make_torch(weights, config, x, y, compile=False, dtype="float32"):
    """nanoGPT's train.py loop body: set the lr, loss.backward(), clip_grad_norm_, AdamW step. On the GPU when
    JAX runs on one (then each step ends with a synchronize, so the timer sees the GPU's work), with nanoGPT's
    GPU settings: fused AdamW, and bfloat16 under torch.autocast when `dtype` is bfloat16."""
    import contextlib

    import torch

    torch.set_num_threads(2)
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("JAX runs on a GPU but this torch has no CUDA: install a CUDA build of torch")
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    model = torch_model(weights, config).to(device)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": TRAIN.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2), fused=device == "cuda")
    forward = torch.compile(model) if compile else model
    x, y = (torch.from_numpy(np.asarray(a, np.int64)).to(device) for a in (x, y))
    autocast = lambda: (torch.autocast(device, dtype=getattr(torch, dtype)) if dtype != "float32"  # noqa: E731
                        else contextlib.nullcontext())  # fmt: skip
    it = 0

    def step():
        nonlocal it
        for group in opt.param_groups:
            group["lr"] = float(nanogpt_lr(it))
        with autocast():
            loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.detach()

    return step


def make_haiku(weights, config, x, y, dtype="float32"):
    """The Haiku peer, from bench/gpt_train_haiku.py (imported here: it builds on this module's pieces)."""
    from bench import gpt_train_haiku

    return gpt_train_haiku.make_haiku(weights, config, x, y, dtype=dtype)


MAKERS = {
    "purejax": make_purejax,
    "purejax-scan": partial(make_purejax, layers="scan"),
    "purejax-loop": partial(make_purejax, layers="loop"),
    "raw": make_raw,
    "raw-scan": partial(make_raw, stacked=True),
    "nnx": make_nnx,
    "nnx-tree": partial(make_nnx, mode="tree"),
    "nnx-split": partial(make_nnx, mode="split"),
    "equinox": make_equinox,
    "haiku": make_haiku,
    "torch": make_torch,
    "torch-compile": partial(make_torch, compile=True),
}


# ---------------------------------------------------------------- the run


PERTURBATION = {"scale": 0.1, "bias": 0.5, "b": 0.5}  # std of the noise on LayerNorm scales and biases, linear biases


def initial_weights(config):
    """purejax's `gpt.init` (key 0) as numpy, with every LayerNorm scale and bias and every linear bias moved off
    its initial 1 or 0 by normal noise (`PERTURBATION`'s std) from a fixed rng: at 1 and 0 a peer that dropped a
    bias or a LayerNorm scale would report the same loss as the others; moved, it is 2e-4 to 2e-3 away in
    float32 (relative; the check is at 1e-5: tests/bench/test_bench_gpt_train.py), while the initial loss stays
    as near ln(vocab) as before (`run_case` checks it)."""
    weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
    rng = np.random.default_rng(1)

    def perturb(path, a):
        std = PERTURBATION.get(path[-1].key)
        return a if std is None else a + rng.normal(0.0, std, a.shape).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(perturb, weights)


def case_batch(case):
    """The case's one batch (inputs, targets), tokens uniform over the vocabulary from a fixed rng."""
    config = case.model
    data = np.random.default_rng(0).integers(0, config.vocab_size, (case.batch, config.block_size + 1), np.int32)
    return data[:, :-1], data[:, 1:]


def first_losses(peer, weights, config, x, y, dtype="float32"):
    """Build `peer`'s step and take two steps: (step, (the initial weights' loss, the loss after one update),
    seconds from building to the first loss: tracing and compilation included)."""
    start = time.perf_counter()
    step = MAKERS[peer](weights, config, x, y, dtype=dtype)
    loss0 = float(step())
    first = time.perf_counter() - start
    return step, (loss0, float(step())), first


def check_agreement(name, losses, reference, dtype="float32"):
    """Every peer's (first, second) loss equals `reference`'s: same weights and batch, same maths.

    In float32 the first losses agree to float32 rounding; after one AdamW step (lr ~1e-5, the update about
    lr * sign(g)) the peers' different clipping and epsilon placement stay far below 1e-4. In bfloat16 (8 bits
    of mantissa) each framework rounds in other places: 1% is what is checked."""
    rtol = (1e-5, 1e-4) if dtype == "float32" else (1e-2, 1e-2)
    for peer, (loss0, loss1) in losses.items():
        np.testing.assert_allclose(loss0, reference[0], rtol=rtol[0], err_msg=f"{name}: {peer}'s initial loss differs")
        np.testing.assert_allclose(loss1, reference[1], rtol=rtol[1], err_msg=f"{name}: {peer}'s next loss differs")


def run_case(name, case, peers, repeats, dtype="float32"):
    """Build every contender, check that their first two losses agree, time them interleaved. Returns per peer
    (median step seconds, first call seconds), or the error message of a peer that could not run."""
    config = case.model
    weights, (x, y) = initial_weights(config), case_batch(case)
    print(f"\n{name}: {config}, batch {case.batch}", flush=True)

    steps, losses, first, failed = {}, {}, {}, {}
    for peer in peers:
        try:
            steps[peer], losses[peer], first[peer] = first_losses(peer, weights, config, x, y, dtype)
            print(f"  {peer:14s} first call {first[peer]:6.2f}s, losses {losses[peer][0]:.7f} {losses[peer][1]:.7f}",
                  flush=True)  # fmt: skip
        except Exception as e:  # a peer that cannot run here (e.g. torch.compile without a compiler) is reported
            failed[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"  {peer:14s} FAILED: {failed[peer]}", flush=True)
            traceback.print_exc(limit=3)

    reference = losses.get("purejax") or next(iter(losses.values()))
    check_agreement(name, losses, reference, dtype)
    # Near-uniform logits at init: the tied head's have std ~0.02 * sqrt(n_embd), which lifts the loss above
    # ln(vocab) by about half their variance (measured 0.15 at GPT-2's n_embd 768, 0.06 at 384): 5% of ln(vocab)
    # passes those and still fails broken weights.
    ln_vocab = math.log(config.vocab_size)
    assert abs(reference[0] / ln_vocab - 1) < 0.05, (
        f"{name}: initial loss {reference[0]} is not ~ln(vocab) = {ln_vocab}"
    )

    timed = list(steps)
    iters = None if case.sample_seconds else 1
    seconds = interleaved_medians([steps[p] for p in timed], (), repeats or case.repeats, iters=iters,
                                  sample_seconds=case.sample_seconds or 0.05)  # fmt: skip
    return {peer: (seconds[timed.index(peer)], first[peer]) if peer in steps else failed[peer] for peer in peers}


def table_rows(name, case, results, peak):
    """Markdown cells per peer: a failure's message, or step ms, tokens/s, time / purejax, MFU, first call s."""
    tokens = case.batch * case.model.block_size
    base = results["purejax"][0] if isinstance(results.get("purejax"), tuple) else None
    for peer, result in results.items():
        if isinstance(result, str):
            yield name, peer, "failed", "", "", "", "", result
            continue
        s, first = result
        mfu = gpt.estimate_mfu(case.model, tokens / s, peak)
        ratio = f"{s / base:.2f}" if base else ""
        yield name, peer, f"{s * 1e3:.2f}", f"{tokens / s:,.0f}", ratio, f"{mfu:.1%}", f"{first:.1f}", ""


def versions() -> str:
    out = [f"jax {jax.__version__}"]
    for module in ("flax", "equinox", "haiku", "optax", "torch"):
        try:
            out.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            out.append(f"{module} not installed")
    return ", ".join(out)


def mfu_peak(platform: str, device_kind: str, rates: list[float]) -> tuple[float, str]:
    """(FLOP/s that MFU is against, what it is): an accelerator's dense bfloat16 peak from the vendors' table
    (`run.PEAK_BF16_FLOPS`), else (a CPU, an unknown chip) the best of the float32 matmul `rates` measured
    during the run: on a shared machine, slower ones met other jobs."""
    peak = run.accelerator_peak_flops(device_kind) if platform != "cpu" else None
    if peak:
        return peak, f"{device_kind}'s dense bfloat16 peak, {peak / 1e12:.0f} TFLOP/s (the vendor's data sheet)"
    return max(rates), (f"the best float32 matmul rate (1024^3, jitted), 3 at the start and 3 at the end: "
                        f"{', '.join(f'{r / 1e9:.0f}' for r in rates)} GFLOP/s")  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,baby,small", help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--bias", default="false", choices=("false", "true", "both"),
                        help="each config without biases, with GPT-2's (labelled CONFIG-bias), or both")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None, help="samples per contender (default: 9, 7, 3 by config)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="compute dtype (weights stay float32); auto: bfloat16 on a GPU/TPU, else float32",
    )
    args = parser.parse_args(argv)
    configs, peers = args.configs.split(","), args.peers.split(",")
    for kind, given, valid in (("config", configs, CASES), ("peer", peers, PEERS)):
        unknown = [g for g in given if g not in valid]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")

    dtype = resolve_compute_dtype(args.dtype, jax.default_backend())
    if jax.default_backend() == "gpu" and dtype == "float32":  # float32 as torch computes it: no TensorFloat-32
        jax.config.update("jax_default_matmul_precision", "highest")
    start = time.perf_counter()
    rates = [run.measure_matmul_flops() for _ in range(3)]
    load = os.getloadavg()[0]
    print(f"{versions()}; backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs, "
          f"load average {load:.1f}; compute dtype {dtype}")  # fmt: skip
    runs = cases(configs, args.bias)
    results = {name: run_case(name, case, peers, args.repeats, dtype) for name, case in runs.items()}
    rates += [run.measure_matmul_flops() for _ in range(3)]
    peak, what = mfu_peak(jax.default_backend(), jax.devices()[0].device_kind, rates)
    print(f"\nMFU is against {what}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; total {time.perf_counter() - start:.0f}s\n")
    header = ("config", "peer", "step ms", "tokens/s", "time / purejax", "MFU", "first s", "note")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, rows in results.items():
        for row in table_rows(name, runs[name], rows, peak):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
