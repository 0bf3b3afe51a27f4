"""One peer's start for bench/first_step.py: a fresh process that trains the default GPT (train.gpt's gpt_cpu
preset: 4 x 128, context 64, batch 12, 108 characters) for one step, in raw JAX or Flax NNX, and says when
that step has finished.

    python -m bench.first_step_peer raw|nnx      # prints "scaffolding <s>" then "first step done"

The peer's own imports (jax and optax, or flax) and everything it does up to the finished step count: building
its modules (NNX initialises its params in them), its optimizer state, the jitted step and its first call. Its
model and step are bench/gpt_train.py's (`make_raw`, `make_nnx`); importing those, and drawing the weights in
numpy (the cheapest start a peer could take: no JAX operation to compile), is the benchmark's scaffolding,
which a peer's user would not run: the child times it and bench/first_step.py subtracts it.
"""

import sys
import time

PEER = sys.argv[1] if len(sys.argv) > 1 else "raw"

import jax  # noqa: E402  (the peer's own imports: counted)
import jax.numpy as jnp  # noqa: E402, F401
import optax  # noqa: E402, F401

if PEER == "nnx":
    from flax import nnx  # noqa: F401

SCAFFOLD_START = time.perf_counter()
import numpy as np  # noqa: E402

from bench.gpt_train_nnx import make_nnx  # noqa: E402
from bench.gpt_train_raw import make_raw  # noqa: E402
from models import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(block_size=64, vocab_size=108, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
BATCH = 12


def numpy_weights(config: gpt.GPTConfig) -> dict:
    """GPT-2's initialisation (normal, std 0.02; LayerNorm scales 1) in purejax's layout, drawn by numpy."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))  # traced, not compiled

    def draw(path, s):
        if path[-1].key == "scale":
            return np.ones(s.shape, s.dtype)
        return (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def main() -> None:
    weights = numpy_weights(CONFIG)
    rng = np.random.default_rng(1)
    x, y = (rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), dtype=np.int32) for _ in range(2))
    scaffolding = time.perf_counter() - SCAFFOLD_START
    step = make_nnx(weights, CONFIG, x, y) if PEER == "nnx" else make_raw(weights, CONFIG, x, y)
    jax.block_until_ready(step())
    print(f"scaffolding {scaffolding:.3f}", flush=True)
    print("first step done", flush=True)


if __name__ == "__main__":
    main()
