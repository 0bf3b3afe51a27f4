"""One MobileNetV2 training step: purejax with each depthwise path against the same network in Flax NNX.

    python -m bench.mobilenet [--image_size 32] [--width 0.5] [--batch 32] [--repeats 5]

The step: forward in train mode (BatchNorm with batch statistics, running statistics updated), softmax
cross-entropy, backward, AdamW (lr 1e-3, weight decay 1e-4, optax's defaults otherwise), no dropout. The NNX
model is built with the same layer names and copied from purejax's initial weights, and the run checks that
both report the same loss on the first two steps before timing anything.

Contenders:
    purejax-xla     models/mobilenet.py, depthwise_impl="xla" (lax.conv_general_dilated, feature groups)
    purejax-shifts  the same with depthwise_impl="shifts" (9 shifted slices; "auto" picks it on CPU)
    nnx             flax.nnx.Conv (feature_group_count for depthwise) + nnx.BatchNorm, nnx.Optimizer, nnx.jit
Median step time from interleaved samples (bench/timing.py); "first s" includes tracing and compilation.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.timing import interleaved_medians
from models import mobilenet
from purejax import losses, optim
from purejax import tree as tree_lib
from train import classify

LR, WEIGHT_DECAY = 1e-3, 1e-4


def purejax_step(config):
    optimizer = optim.adamw(LR, weight_decay=WEIGHT_DECAY)
    params = mobilenet.init(jax.random.key(0), config)
    state = optim.init_train_state(params, optimizer, jax.random.key(1), model_state=mobilenet.init_state(config))
    step = jax.jit(
        functools.partial(optim.train_step, loss_fn=classify.make_loss_fn(config), optimizer=optimizer),
        donate_argnums=0,
    )
    return params, step, [state]


def nnx_model(config, params):
    """The same network in Flax NNX, with purejax's weights copied in (same names, same HWIO layout)."""
    from flax import nnx

    rngs = nnx.Rngs(0)

    class Unit(nnx.Module):
        def __init__(self, p, groups, stride):
            kh, kw, cin, cout = p["conv"]["w"].shape
            self.conv = nnx.Conv(
                cin * groups,
                cout,
                (kh, kw),
                strides=stride,
                padding=((kh // 2,) * 2,) * 2,
                feature_group_count=groups,
                use_bias=False,
                rngs=rngs,
            )
            self.conv.kernel.value = p["conv"]["w"]
            self.bn = nnx.BatchNorm(cout, momentum=1 - config.bn_momentum, epsilon=config.bn_eps, rngs=rngs)
            self.bn.scale.value, self.bn.bias.value = p["bn"]["scale"], p["bn"]["bias"]

        def __call__(self, x, act=True):
            y = self.bn(self.conv(x))
            return jax.nn.relu6(y) if act else y

    class Block(nnx.Module):
        def __init__(self, p, block):
            self.expand = Unit(p["expand"], 1, 1) if "expand" in p else None
            self.depthwise = Unit(p["depthwise"], p["depthwise"]["conv"]["w"].shape[-1], block.stride)
            self.project = Unit(p["project"], 1, 1)
            self.residual = block.stride == 1 and block.in_channels == block.out_channels

        def __call__(self, x):
            h = self.expand(x) if self.expand is not None else x
            h = self.project(self.depthwise(h), act=False)
            return x + h if self.residual else h

    class Net(nnx.Module):
        def __init__(self):
            self.stem = Unit(params["stem"], 1, config.stem_stride)
            self.blocks = nnx.List([Block(params[b.name], b) for b in config.blocks()])
            self.last = Unit(params["last"], 1, 1)
            self.classifier = nnx.Linear(config.last_channels, config.n_classes, rngs=rngs)
            self.classifier.kernel.value, self.classifier.bias.value = (
                params["classifier"]["w"],
                params["classifier"]["b"],
            )

        def __call__(self, x):
            h = self.stem(x)
            for block in self.blocks:
                h = block(h)
            return self.classifier(jnp.mean(self.last(h), axis=(1, 2)))

    return Net()


def nnx_step(config, params):
    from flax import nnx

    model = nnx_model(config, params)
    model.train()
    decay_matrices = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    opt = nnx.Optimizer(model, optax.adamw(LR, weight_decay=WEIGHT_DECAY, mask=decay_matrices), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        x, y = batch

        def loss_fn(model):
            return jnp.mean(losses.cross_entropy(model(x), y))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    return step, model, opt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batch = (
        jnp.asarray(rng.uniform(size=(args.batch, args.image_size, args.image_size, 3)), jnp.float32),
        jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32),
    )
    base = dict(n_classes=10, image_size=args.image_size, width_mult=args.width, dropout=0.0)
    contenders, first, losses_seen = {}, {}, {}
    for impl in ("xla", "shifts"):
        config = mobilenet.MobileNetConfig(**base, depthwise_impl=impl)
        params, step, holder = purejax_step(config)

        def run(step=step, holder=holder):
            holder[0], metrics = step(holder[0], batch)
            return metrics["loss"]

        contenders[f"purejax-{impl}"] = run
    config = mobilenet.MobileNetConfig(**base)
    params = mobilenet.init(jax.random.key(0), config)
    step, model, opt = nnx_step(config, params)
    contenders["nnx"] = lambda: step(model, opt, batch)
    print(
        f"MobileNetV2 width {args.width}, {args.image_size}x{args.image_size}x3, batch {args.batch}, "
        f"{tree_lib.count(params) / 1e6:.2f}M params, {config.downsamples} stride-2 layers; "
        f"backend {jax.default_backend()}"
    )
    for name, fn in contenders.items():
        start = time.perf_counter()
        losses_seen[name] = [float(fn()), float(fn())]
        first[name] = time.perf_counter() - start
    reference = losses_seen["purejax-xla"]
    for name, seen in losses_seen.items():
        # The first loss is the initial weights'; the second follows one AdamW step, which divides every gradient
        # by its own root mean square, so float rounding in near-zero gradients moves it by ~1e-4.
        agree = np.isclose(seen[0], reference[0], rtol=1e-5) and np.isclose(seen[1], reference[1], rtol=1e-3)
        assert agree, f"{name} computes another loss: {seen} against {reference}"
    print(f"the same loss on the first two steps: {losses_seen}")
    medians = interleaved_medians(list(contenders.values()), (), args.repeats)
    base_time = medians[0]
    print("\n| contender | first 2 steps s | step ms | vs purejax-xla |\n|---|---:|---:|---:|")
    for (name, _), t in zip(contenders.items(), medians):
        print(f"| {name} | {first[name]:.1f} | {t * 1e3:.1f} | {t / base_time:.2f}x |")


if __name__ == "__main__":
    main()
