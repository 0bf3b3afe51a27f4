"""Depthwise 3x3 convolution: XLA's grouped convolution against purejax's shifted multiply-adds.

    python -m bench.conv [--batch 8] [--repeats 5]

For the depthwise layers of MobileNetV2 at 224x224 input (stride 1 and 2, torch's symmetric padding 1), the
median time of a jitted forward pass and of a jitted forward+backward (gradients for the input and the
kernel) for `lax.conv_general_dilated` with feature_group_count = channels, and for
`conv.apply(..., depthwise_impl="shifts")`. Both are measured interleaved (A, B, A, B, ...) so machine
noise hits them alike; ratio = XLA time / shifts time. This is the measurement behind `conv.apply`'s "auto"
choice per backend.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import interleaved_medians
from purejax.nn import conv

# (height = width, channels, stride) of MobileNetV2's depthwise layers at 224x224 input.
SHAPES = [(112, 32, 1), (112, 96, 2), (56, 144, 1), (56, 144, 2), (28, 192, 1), (28, 192, 2), (14, 384, 1), (7, 960, 1)]


def xla_depthwise(x, w, stride):
    return jax.lax.conv_general_dilated(
        x,
        w,
        (stride, stride),
        ((1, 1), (1, 1)),
        feature_group_count=x.shape[-1],
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def shifts_depthwise(x, w, stride):
    return conv.apply({"w": w}, x, stride=stride, padding=1, groups=x.shape[-1], depthwise_impl="shifts")


def forward_backward(fn):
    """The gradients for (x, w) of <fn(x, w), dy>: one forward and one backward pass."""
    return jax.grad(lambda x, w, dy, stride: jnp.vdot(fn(x, w, stride), dy), argnums=(0, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    print(
        f"backend {device}, jax {jax.__version__}, batch {args.batch}, median of {args.repeats}; "
        f"conv.apply's 'auto' uses shifts on {list(conv.SHIFTS_BACKENDS)}"
    )
    print()
    print(
        "| input (NHWC) | stride | fwd XLA ms | fwd shifts ms | fwd ratio "
        "| fwd+bwd XLA ms | fwd+bwd shifts ms | fwd+bwd ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for size, channels, stride in SHAPES:
        x = jnp.asarray(rng.normal(size=(args.batch, size, size, channels)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(3, 3, 1, channels)) / 3, jnp.float32)
        out_size = (size + 2 - 3) // stride + 1
        dy = jnp.asarray(rng.normal(size=(args.batch, out_size, out_size, channels)), jnp.float32)
        fwd = [jax.jit(f, static_argnums=2) for f in (xla_depthwise, shifts_depthwise)]
        np.testing.assert_allclose(fwd[0](x, w, stride), fwd[1](x, w, stride), rtol=1e-4, atol=1e-4)  # same maths
        fwd_times = interleaved_medians(
            [lambda x, w, f=f, stride=stride: f(x, w, stride) for f in fwd], (x, w), args.repeats
        )
        bwd = [jax.jit(forward_backward(f), static_argnums=3) for f in (xla_depthwise, shifts_depthwise)]
        bwd_times = interleaved_medians(
            [lambda x, w, dy, f=f, stride=stride: f(x, w, dy, stride) for f in bwd], (x, w, dy), args.repeats
        )
        (fx, fs), (bx, bs) = fwd_times, bwd_times
        print(
            f"| {args.batch}x{size}x{size}x{channels} | {stride} | {fx * 1e3:.2f} | {fs * 1e3:.2f} | {fx / fs:.1f} "
            f"| {bx * 1e3:.2f} | {bs * 1e3:.2f} | {bx / bs:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
