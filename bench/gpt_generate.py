"""Generation speed: `purejax.models.gpt_decode.generate` (key/value cache, one compiled scan) against nanoGPT's
way, which runs the whole context through the model for every new token.

    python -m bench.gpt_generate [--block 256] [--prompt 16] [--batch 1] [--repeats 3]

The model has nanoGPT's shakespeare-char shape (6 layers, 6 heads, 384 wide, vocab 65) at the given block
size, with random weights. From a short prompt, both produce block - prompt tokens greedily, so nanoGPT's
context grows from the prompt to the whole block and never needs cropping.

The baseline is nanoGPT's loop in JAX: a Python loop that, for each token, runs the jitted forward pass on
the context so far and takes the arg-max of the last position. Jitting every context length would compile
block - prompt programs, so the context is right-padded to the next multiple of 32 (the causal mask keeps
the padding out of every real position) and the last real position is read: the work per token is within
32 positions of nanoGPT's. Every bucket is compiled before timing. Both produce the same tokens (checked).
"""

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from purejax.models import gpt, gpt_decode

BUCKET = 32


def recompute_generate(params, prompt, config, max_new_tokens):
    """nanoGPT's generate (greedy): the whole context forward for every token, one jitted call per token."""
    idx = np.asarray(prompt)
    for _ in range(max_new_tokens):
        context = idx[:, -config.block_size :]
        n = context.shape[1]
        padded = np.pad(context, ((0, 0), (0, -n % BUCKET)))
        next_id = _last_argmax(params, jnp.asarray(padded), jnp.int32(n - 1), config)
        idx = np.concatenate([idx, np.asarray(next_id)[:, None]], axis=1)
    return idx


@partial(jax.jit, static_argnames="config")
def _last_argmax(params, padded, last, config):
    h = gpt.hidden(params, padded, config)
    logits = h[:, last] @ params["wte"]["w"].T
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    config = gpt.GPTConfig(block_size=args.block, vocab_size=65, n_layer=6, n_head=6, n_embd=384)
    params = jax.jit(gpt.init, static_argnames="config")(jax.random.key(0), config)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 65, (args.batch, args.prompt)), jnp.int32)
    new = args.block - args.prompt
    key = jax.random.key(1)

    def cached():
        out = gpt_decode.generate(params, prompt, config, key=key, max_new_tokens=new, temperature=0.0)
        return jax.block_until_ready(out)

    def recompute():
        return recompute_generate(params, prompt, config, new)

    start = time.perf_counter()
    ours = np.asarray(cached())
    compile_cached = time.perf_counter() - start
    start = time.perf_counter()
    theirs = recompute()  # compiles every bucket
    compile_recompute = time.perf_counter() - start
    agree = float(np.mean(ours == theirs))

    times = {"cached": [], "recompute": []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for name, fn in (("cached", cached), ("recompute", recompute)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {config}")
    print(f"batch {args.batch}, prompt {args.prompt}, {new} new tokens, median of {args.repeats}")
    print(f"tokens equal in both: {agree:.1%}")
    print(f"{'':28s} {'seconds':>9s} {'tokens/s':>10s} {'first call (compile) s':>24s}")
    for name, label, first in (("cached", "KV cache (gpt_decode.generate)", compile_cached),
                               ("recompute", "recompute (nanoGPT's way)", compile_recompute)):  # fmt: skip
        t = statistics.median(times[name])
        print(f"{label:28s} {t:9.3f} {args.batch * new / t:10.1f} {first:24.1f}")
    speedup = statistics.median(times["recompute"]) / statistics.median(times["cached"])
    print(f"speed-up of the cache: {speedup:.1f}x")


if __name__ == "__main__":
    main()
