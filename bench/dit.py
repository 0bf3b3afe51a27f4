"""One DiT training step, purejax against the same model in Flax NNX.

    python -m bench.dit [--configs digits,ti16] [--repeats N]

The step: the DiT forward on a fixed batch of noisy inputs, times and labels, mean squared error against a
fixed target velocity, backward, global-norm clipping at 1.0, AdamW (lr 1e-3, betas 0.9/0.999, no weight
decay), float32. Both contenders start from the SAME weights (purejax's `dit.init` plus noise, copied into
the NNX modules) and must report the same loss on the first two steps before anything is timed.

Contenders:
    purejax        models/dit.py + optim.train_step, blocks under lax.scan (as train/flow.py runs it)
    purejax-loop   the same with DiTConfig(layers="loop"): blocks unrolled
    nnx            Flax NNX modules (blocks in an nnx.List, a Python loop), optax, `nnx.jit`

Configs: "digits" is train/flow.py's default model and batch (8x8x1 digits, patch 2, 4x96, batch 64);
"ti16" is DiT-Ti/2 (4 layers, 128 wide) on 16x16x4 latents (64 tokens), batch 16.
Times are medians of interleaved samples (bench/timing.py); a shared machine makes them noisy.
"""

import argparse
import dataclasses
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import interleaved_medians
from models import dit
from purejax import optim
from purejax.nn import attention

CASES = {
    "digits": (
        dit.DiTConfig(
            input_size=8,
            patch_size=2,
            in_channels=1,
            d_model=96,
            n_layer=4,
            n_head=4,
            n_classes=10,
            learn_sigma=False,
            time_scale=1000.0,
        ),
        64,
    ),
    "ti16": (dit.preset("Ti/2", input_size=16, in_channels=4, n_classes=10, learn_sigma=False, time_scale=1000.0), 16),
}
PEERS = ("purejax", "purejax-loop", "nnx")
LR, CLIP = 1e-3, 1.0


def make_batch(config: dit.DiTConfig, batch: int):
    rng = np.random.default_rng(0)
    shape = (batch, config.input_size, config.input_size, config.in_channels)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    t = jnp.asarray(rng.uniform(size=batch), jnp.float32)
    y = jnp.asarray(rng.integers(0, config.n_classes + 1, batch))
    noise = jnp.asarray(rng.normal(size=shape), jnp.float32)
    return x, t, y, noise


def make_weights(config: dit.DiTConfig):
    """dit.init plus N(0, 0.02^2) noise, so the zero-initialised modulation is not trivially zero."""
    rng = np.random.default_rng(1)
    return jax.tree.map(
        lambda a: np.asarray(a) + rng.normal(0, 0.02, a.shape).astype(np.float32), dit.init(jax.random.key(0), config)
    )


def make_purejax(weights, config, batch, layers="scan"):
    config = dataclasses.replace(config, layers=layers)

    def loss_fn(params, batch, key):
        z, t, y, target = batch
        return jnp.mean(jnp.square(dit.velocity(params, z, t, y, config) - target)), {}

    optimizer = optim.adamw(LR, weight_decay=0.0)
    step_fn = jax.jit(
        partial(optim.train_step, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=CLIP), donate_argnums=0
    )
    state = optim.init_train_state(jax.tree.map(jnp.array, weights), optimizer, jax.random.key(0))

    def step():
        nonlocal state
        state, metrics = step_fn(state, batch)
        return metrics["loss"]

    return step


def nnx_model(weights, config):
    """DiT in Flax NNX, the weights copied from purejax's tree. The NNX attention splits its fused qkv
    columns [all q | all k | all v] (timm's and DiT's layout); purejax's grouped columns are converted with
    `attention.qkv_permutation`."""
    from flax import nnx

    d, heads = config.d_model, config.n_head

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.adaln = nnx.Linear(d, 6 * d, rngs=rngs)
            self.qkv, self.attn_proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
            self.fc, self.mlp_proj = nnx.Linear(d, config.d_ff, rngs=rngs), nnx.Linear(config.d_ff, d, rngs=rngs)
            self.norm = nnx.LayerNorm(d, epsilon=1e-6, use_bias=False, use_scale=False, rngs=rngs)

        def __call__(self, x, c):
            s1, sc1, g1, s2, sc2, g2 = jnp.split(self.adaln(nnx.silu(c))[:, None], 6, axis=-1)
            b, n, _ = x.shape
            q, k, v = (
                a.reshape(b, n, heads, d // heads) for a in jnp.split(self.qkv(self.norm(x) * (1 + sc1) + s1), 3, -1)
            )
            x = x + g1 * self.attn_proj(jax.nn.dot_product_attention(q, k, v).reshape(b, n, d))
            h = nnx.gelu(self.fc(self.norm(x) * (1 + sc2) + s2), approximate=True)
            return x + g2 * self.mlp_proj(h)

    class DiT(nnx.Module):
        def __init__(self, rngs):
            p = config.patch_size
            self.patch = nnx.Linear(p * p * config.in_channels, d, rngs=rngs)
            self.t_fc, self.t_proj = nnx.Linear(config.freq_dim, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
            self.classes = nnx.Embed(config.n_classes + 1, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(config.n_layer)])
            self.final_adaln, self.final_proj = (
                nnx.Linear(d, 2 * d, rngs=rngs),
                nnx.Linear(d, p * p * config.out_channels, rngs=rngs),
            )
            self.norm = nnx.LayerNorm(d, epsilon=1e-6, use_bias=False, use_scale=False, rngs=rngs)

        def __call__(self, x, t, y):
            h = self.patch(dit.patchify(x, config.patch_size)) + dit.sincos_2d(d, config.grid)
            freqs = dit.timestep_embedding(config.time_scale * t, config.freq_dim)
            c = self.t_proj(nnx.silu(self.t_fc(freqs))) + self.classes(y)
            for block in self.blocks:
                h = block(h, c)
            shift, scale = jnp.split(self.final_adaln(nnx.silu(c))[:, None], 2, axis=-1)
            out = self.final_proj(self.norm(h) * (1 + scale) + shift)
            return dit.unpatchify(out, config.patch_size, config.out_channels)

    model = DiT(nnx.Rngs(0))

    def copy(module, linear):
        module.kernel.value, module.bias.value = jnp.array(linear["w"]), jnp.array(linear["b"])

    copy(model.patch, weights["patch"])
    copy(model.t_fc, weights["t_mlp"]["fc"])
    copy(model.t_proj, weights["t_mlp"]["proj"])
    model.classes.embedding.value = jnp.array(weights["classes"]["w"])
    copy(model.final_adaln, weights["final"]["adaln"])
    copy(model.final_proj, weights["final"]["proj"])
    to_split = np.argsort(attention.qkv_permutation(config.attention))
    for i, block in enumerate(model.blocks):
        w = jax.tree.map(lambda a, i=i: a[i], weights["blocks"])
        qkv = {name: a[..., to_split] for name, a in w["attn"]["qkv"].items()}
        for module, linear in (
            (block.adaln, w["adaln"]),
            (block.qkv, qkv),
            (block.attn_proj, w["attn"]["proj"]),
            (block.fc, w["mlp"]["fc"]),
            (block.mlp_proj, w["mlp"]["proj"]),
        ):
            copy(module, linear)
    return model


def make_nnx(weights, config, batch):
    import optax
    from flax import nnx

    model = nnx_model(weights, config)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=0.0)), wrt=nnx.Param
    )
    z, t, y, target = batch

    @nnx.jit
    def train_step(model, optimizer, z, t, y, target):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(z, t, y) - target)))(model)
        optimizer.update(model, grads)
        return loss

    return lambda: train_step(model, optimizer, z, t, y, target)


MAKERS = {"purejax": make_purejax, "purejax-loop": partial(make_purejax, layers="loop"), "nnx": make_nnx}


def run_case(name: str, repeats: int) -> list[tuple[str, float, float]]:
    config, batch_size = CASES[name]
    weights, batch = make_weights(config), make_batch(config, batch_size)
    steps, firsts, losses = [], [], []
    for peer in PEERS:
        step = MAKERS[peer](weights, config, batch)
        start = time.perf_counter()
        first = float(step())
        firsts.append(time.perf_counter() - start)
        losses.append((first, float(step())))
        steps.append(step)
    print(
        f"{name}: losses on the first two steps: "
        + ", ".join(f"{p} {a:.6f} {b:.6f}" for p, (a, b) in zip(PEERS, losses))
    )
    reference = np.array(losses[0])
    for peer, pair in zip(PEERS, losses):
        if not np.allclose(pair, reference, rtol=2e-4):
            raise SystemExit(f"{name}: {peer} reports losses {pair}, purejax {tuple(reference)}: not the same model")
    times = interleaved_medians(steps, (), repeats)
    return [(peer, t, f) for peer, t, f in zip(PEERS, times, firsts)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="digits,ti16", help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CASES]
    if unknown:
        parser.error(f"unknown config {', '.join(unknown)}; valid: {', '.join(CASES)}")
    import flax

    print(
        f"jax {jax.__version__}, flax {flax.__version__}; backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results = {name: run_case(name, args.repeats) for name in args.configs.split(",")}
    print(f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| config | peer | step ms | time / purejax | first call s |\n|---|---|---:|---:|---:|")
    for name, rows in results.items():
        base = rows[0][1]
        for peer, t, first in rows:
            print(f"| {name} | {peer} | {t * 1e3:.2f} | {t / base:.2f} | {first:.1f} |")


if __name__ == "__main__":
    main()
