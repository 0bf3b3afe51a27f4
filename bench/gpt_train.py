"""One GPT training step, purejax against the same model in raw JAX, Flax NNX, Equinox, Haiku and PyTorch.

    python -m bench.gpt_train [--configs tiny,baby,small] [--repeats N] [--peers purejax,raw,nnx,...]
    python -m bench.gpt_train --configs gpt2       # GPT-2 124M on a GPU: bfloat16, MFU against the chip's peak

The step is nanoGPT's: forward, backward, global-norm gradient clipping at 1.0, then AdamW (betas 0.9/0.99,
weight decay 0.1 on tensors with ndim >= 2 only, warmup + cosine learning rate), no dropout, in `--dtype`
("auto": float32 on a CPU, bfloat16 compute with float32 weights and optimizer state on a GPU or TPU), on
nanoGPT's architecture with bias=False (learned positions, pre-LayerNorm blocks, fused qkv causal attention,
4x MLP with exact GELU, final LayerNorm, weight-tied head). Every contender is built from the SAME initial
weights (purejax's `gpt.init`, copied into each framework's modules) and fed the same batch, so before any
timing the run checks that all of them report the same loss on the first step (the initial weights) and on
the second (after one identical update).

Contenders (`--peers`, default all but raw-scan):
    purejax        purejax/models/gpt.py + purejax.optim, built exactly as purejax/train/gpt.py builds its step
                   (scan over layers)
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
    return gpt.GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd, dropout=0.0, bias=False)  # fmt: skip


CASES = {
    "tiny": Case(_config(2, 2, 32, 32), batch=8, repeats=9, sample_seconds=0.1),  # dispatch-bound
    "baby": Case(_config(4, 4, 128, 64), batch=12, repeats=7, sample_seconds=0.25),  # nanoGPT's CPU config
    "small": Case(_config(6, 6, 384, 256), batch=4, repeats=3, sample_seconds=None),  # shakespeare-char shaped
    # GPT-2 124M (GPT-2's vocabulary padded to 50304, nanoGPT's; no biases): for a GPU
    "gpt2": Case(_config(12, 12, 768, 1024, vocab_size=50304), batch=16, repeats=5, sample_seconds=1.0),
}
PEERS = ("purejax", "purejax-loop", "raw", "raw-scan", "nnx", "nnx-tree", "nnx-split", "equinox", "haiku", "torch",
         "torch-compile")  # fmt: skip
DEFAULT_PEERS = tuple(p for p in PEERS if p != "raw-scan")  # raw-scan on request: it keeps the run under 6 minutes


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


def make_purejax(weights, config, x, y, layers="scan", *, optimizer=None, donate=True, dtype="float32"):
    """The step of purejax/train/gpt.py: optim.train_step with make_optimizer and make_loss_fn, jitted, state donated.
    `optimizer` and `donate` let bench/gpt_anatomy.py time variants of the same step."""
    model = dataclasses.replace(config, layers=layers)
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


def raw_weights(weights, config, stacked: bool):
    """purejax's layout -> {"wte", "wpe", "ln_f", "blocks"}: a list of per-layer dicts, or (stacked) one dict.
    The fused qkv columns go from purejax's per-head grouped order to nanoGPT's [q | k | v], which every peer
    splits in three (the same conversion as for Hugging Face files)."""
    b = weights["blocks"]
    qkv = gpt_hf.qkv_to_hf(np.asarray(b["attn"]["qkv"]["w"]), config)
    blocks = {"ln_1": b["ln_1"]["scale"], "qkv": qkv, "attn_proj": b["attn"]["proj"]["w"],
              "ln_2": b["ln_2"]["scale"], "fc": b["mlp"]["fc"]["w"], "mlp_proj": b["mlp"]["proj"]["w"]}  # fmt: skip
    if not stacked:
        blocks = [{k: v[i] for k, v in blocks.items()} for i in range(len(blocks["qkv"]))]
    return {"wte": weights["wte"]["w"], "wpe": weights["wpe"]["w"], "ln_f": weights["ln_f"]["scale"], "blocks": blocks}


def raw_layer_norm(scale, x):
    """LayerNorm without bias, its statistics in float32 whatever the compute dtype (as purejax's)."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    return ((h - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * scale


def raw_block(p, x, n_head):
    b, t, d = x.shape
    q, k, v = jnp.split(raw_layer_norm(p["ln_1"], x) @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(b, t, n_head, d // n_head)  # noqa: E731
    x = x + causal_attention(heads(q), heads(k), heads(v)).reshape(b, t, d) @ p["attn_proj"]
    return x + jax.nn.gelu(raw_layer_norm(p["ln_2"], x) @ p["fc"], approximate=False) @ p["mlp_proj"]


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
    decays = {"wte": True, "wpe": True, "ln_f": False,  # stacked block leaves have a leading layer axis
              "blocks": jax.tree.map(lambda p: p.ndim - stacked >= 2, params["blocks"])}  # fmt: skip
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

    class Block(nnx.Module):
        def __init__(self, d, n_head, rngs):
            self.n_head = n_head
            self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, use_bias=False, rngs=rngs, **kw)
            self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs, **kw)
            self.attn_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs, **kw)
            self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, use_bias=False, rngs=rngs, **kw)
            self.fc = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs, **kw)
            self.mlp_proj = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs, **kw)

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
            self.ln_f = nnx.LayerNorm(c.n_embd, epsilon=1e-5, use_bias=False, rngs=rngs, **kw)

        def __call__(self, idx):
            x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))

    model = GPT(config, nnx.Rngs(0))
    r = raw_weights(weights, config, stacked=False)
    model.wte.embedding.value, model.wpe.embedding.value = jnp.array(r["wte"]), jnp.array(r["wpe"])
    model.ln_f.scale.value = jnp.array(r["ln_f"])
    for block, p in zip(model.blocks, r["blocks"]):
        block.ln_1.scale.value, block.ln_2.scale.value = jnp.array(p["ln_1"]), jnp.array(p["ln_2"])
        for name in ("qkv", "attn_proj", "fc", "mlp_proj"):
            getattr(block, name).kernel.value = jnp.array(p[name])  # flax kernels are (in, out), as ours
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
            self.ln_1, self.ln_2 = (eqx.nn.LayerNorm(d, eps=1e-5, use_bias=False) for _ in range(2))
            self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=keys[0])
            self.attn_proj = eqx.nn.Linear(d, d, use_bias=False, key=keys[1])
            self.fc = eqx.nn.Linear(d, 4 * d, use_bias=False, key=keys[2])
            self.mlp_proj = eqx.nn.Linear(4 * d, d, use_bias=False, key=keys[3])

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
            self.ln_f = eqx.nn.LayerNorm(c.n_embd, eps=1e-5, use_bias=False)

        def __call__(self, idx):  # one sequence of ids (seq,) -> logits (seq, vocab)
            x = self.wte.weight[idx] + self.wpe.weight[: idx.shape[0]]
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.ln_f)(x) @ self.wte.weight.T

    model = GPT(config, jax.random.key(0))
    r = raw_weights(weights, config, stacked=False)
    names = ("ln_1", "ln_2", "qkv", "attn_proj", "fc", "mlp_proj")
    where = lambda m: (m.wte.weight, m.wpe.weight, m.ln_f.weight,  # noqa: E731
                       *[getattr(b, n).weight for b in m.blocks for n in names])  # fmt: skip
    new = [r["wte"], r["wpe"], r["ln_f"]]
    for p in r["blocks"]:  # Equinox's Linear weights are (out, in)
        new += [p[n].T for n in names]  # .T leaves the 1-D LayerNorm scales as they are
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

    class Block(nn.Module):
        def __init__(self, d, n_head):
            super().__init__()
            self.n_head = n_head
            self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.qkv, self.attn_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

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
            self.ln_f = nn.LayerNorm(c.n_embd, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT(config)
    r = raw_weights(weights, config, stacked=False)
    with torch.no_grad():
        for name, value in (("wte", r["wte"]), ("wpe", r["wpe"]), ("ln_f", r["ln_f"])):
            getattr(model, name).weight.copy_(torch.from_numpy(np.array(value)))
        for block, p in zip(model.blocks, r["blocks"]):
            for name in ("ln_1", "ln_2", "qkv", "attn_proj", "fc", "mlp_proj"):
                w = np.asarray(p[name])
                getattr(block, name).weight.copy_(torch.from_numpy(np.array(w.T)))  # torch's Linear is (out, in)
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


def run_case(name, case, peers, repeats, dtype="float32"):
    """Build every contender, check that their first two losses agree, time them interleaved. Returns per peer
    (median step seconds, first call seconds), or the error message of a peer that could not run."""
    config = case.model
    weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
    rng = np.random.default_rng(0)
    data = rng.integers(0, config.vocab_size, (case.batch, config.block_size + 1), dtype=np.int32)
    x, y = data[:, :-1], data[:, 1:]
    print(f"\n{name}: {config}, batch {case.batch}", flush=True)

    steps, losses, first, failed = {}, {}, {}, {}
    for peer in peers:
        try:
            start = time.perf_counter()
            step = MAKERS[peer](weights, config, x, y, dtype=dtype)
            loss0 = float(step())  # the initial weights' loss; tracing and compilation happen here
            first[peer] = time.perf_counter() - start
            losses[peer] = (loss0, float(step()))  # after one identical update
            steps[peer] = step
            print(f"  {peer:14s} first call {first[peer]:6.2f}s, losses {loss0:.7f} {losses[peer][1]:.7f}", flush=True)
        except Exception as e:  # a peer that cannot run here (e.g. torch.compile without a compiler) is reported
            failed[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"  {peer:14s} FAILED: {failed[peer]}", flush=True)
            traceback.print_exc(limit=3)

    reference = losses.get("purejax") or next(iter(losses.values()))
    # Same weights and batch: in float32 the first losses agree to float32 rounding; after one AdamW step (lr
    # ~1e-5, the update about lr * sign(g)) the peers' different clipping and epsilon placement stay far below
    # 1e-4. In bfloat16 (8 bits of mantissa) each framework rounds in other places: 1% is what is checked.
    rtol = (1e-5, 1e-4) if dtype == "float32" else (1e-2, 1e-2)
    for peer, (loss0, loss1) in losses.items():
        np.testing.assert_allclose(loss0, reference[0], rtol=rtol[0], err_msg=f"{name}: {peer}'s initial loss differs")
        np.testing.assert_allclose(
            loss1, reference[1], rtol=rtol[1], err_msg=f"{name}: {peer}'s loss after a step differs"
        )
    ln_vocab = math.log(config.vocab_size)
    assert abs(reference[0] - ln_vocab) < 0.1, f"{name}: initial loss {reference[0]} is not ~ln(vocab) = {ln_vocab}"

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
    results = {name: run_case(name, CASES[name], peers, args.repeats, dtype) for name in configs}
    rates += [run.measure_matmul_flops() for _ in range(3)]
    peak, what = mfu_peak(jax.default_backend(), jax.devices()[0].device_kind, rates)
    print(f"\nMFU is against {what}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; total {time.perf_counter() - start:.0f}s\n")
    header = ("config", "peer", "step ms", "tokens/s", "time / purejax", "MFU", "first s", "note")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, rows in results.items():
        for row in table_rows(name, CASES[name], rows, peak):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
