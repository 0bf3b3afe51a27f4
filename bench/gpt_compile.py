"""Compile time of a GPT training step against depth: blocks under `lax.scan` (layers="scan") against a
Python loop over the layers (layers="loop").

    python -m bench.gpt_compile [--depths 1 2 4 8 16] [--width 128]

For each depth, the seconds to trace and lower `jax.jit(jax.value_and_grad(gpt.loss))` and the seconds XLA
takes to compile it, for a model of the given width (4 heads, block 64, vocab 65, batch 8). scan traces one
block whatever the depth, so its compile time should stay flat; the loop unrolls n_layer blocks.
"""

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp

from models import gpt


def lower_step(config: gpt.GPTConfig, batch: int = 8) -> jax.stages.Lowered:
    """One training step's value and gradient for `config` and `batch` rows, traced and lowered from shapes
    alone (nothing computed), not yet compiled."""
    params = jax.eval_shape(partial(gpt.init, config=config), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch, config.block_size), jnp.int32)
    step = jax.jit(jax.value_and_grad(gpt.loss), static_argnames="config")
    return step.lower(params, (tokens, tokens), config)


def compile_seconds(config: gpt.GPTConfig, batch: int = 8) -> tuple[float, float]:
    """(trace and lower, XLA compile) seconds for one training step's value and gradient."""
    start = time.perf_counter()
    lowered = lower_step(config, batch)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    return traced, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, n_embd {args.width}, 4 heads, block 64")
    header = ("n_layer", "scan trace s", "scan compile s", "loop trace s", "loop compile s")
    print(" ".join(f"{h:>{w}s}" for h, w in zip(header, (7, 13, 15, 13, 15))))
    for depth in args.depths:
        row = []
        for layers in ("scan", "loop"):
            config = gpt.GPTConfig(64, vocab_size=65, n_layer=depth, n_head=4, n_embd=args.width, layers=layers)
            row += compile_seconds(config)
        print(f"{depth:7d} {row[0]:13.2f} {row[1]:15.2f} {row[2]:13.2f} {row[3]:15.2f}")


if __name__ == "__main__":
    main()
