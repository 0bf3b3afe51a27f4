"""Decoding speed of `models.gpt_decode.generate` against its roofline, against the decoding step it
replaced, and (with --recompute) against nanoGPT's way, which runs the whole context for every new token.

    python -m bench.gpt_generate [--block 256] [--prompt 16] [--batches 1 8] [--repeats 7] [--recompute]

The model has nanoGPT's shakespeare-char shape (6 layers, 6 heads, 384 wide, vocab 65) at the given block
size, with random weights. From a short prompt, generation runs greedily to the end of the block.

**Per step.** The time of one decoding step is (t(N tokens) - t(2 tokens)) / (N - 2), N = block - prompt: the
prefill, the dispatch and the last draw cancel. Both calls are timed interleaved (bench/timing.py) with the
same for the step this one replaced, so machine noise hits all alike; medians are reported.

**The floors.** A cached step multiplies one token per row by every weight and reads the whole cache (every
layer's keys and values for block positions: the attention reads all slots, masking the unwritten ones). So
it takes at least (param bytes + cache bytes) / read bandwidth, the memory floor ("floor"; the bandwidth
measured here by bench/membw.py, the best of its reads of a 512 MiB array), and at least its FLOPs / the
matmul rate, the compute floor (`step_flops`: 2 x batch x the weights, plus the attention over every slot,
checked against XLA's cost analysis of the compiled step; the rate: the best of three 1024^3 float32 matmuls,
`bench.timing.measure_matmul_flops`). The roofline is the larger; "x roof" is the step over it. At
batch 1 a step does 2 FLOPs per 4-byte weight and the memory floor rules; the FLOPs grow with the batch and
the weight bytes do not.

**Before** is the step of the previous gpt_decode, rebuilt here from the same pieces (`old_generate`): one
stacked cache (n_layer, batch, block, heads, head_dim) threaded through a `lax.scan` over the layers, which
slices every layer's params and cache out of the stacks and stacks the updated caches again at every step.
"""

import argparse
import os
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench import membw, timing
from models import gpt, gpt_decode
from purejax import tree as tree_lib
from purejax.nn import attention, embedding, layer_norm, linear, mlp, stack

BUCKET = 32


@partial(jax.jit, static_argnames=("config", "max_new_tokens"))
def old_generate(params, prompt, config, max_new_tokens):
    """The previous gpt_decode.generate, greedy, within the block: a stacked cache scanned over the layers."""
    batch, (n_kv_head, head_dim) = prompt.shape[0], (config.attention.n_kv_head, config.attention.head_dim)
    shape = (config.n_layer, batch, config.block_size, n_kv_head, head_dim)
    cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape), "index": jnp.zeros((config.n_layer,), jnp.int32)}

    def hidden(cache, idx):
        x = embedding.apply(params["wte"], idx) + embedding.apply(
            params["wpe"], cache["index"][0] + jnp.arange(idx.shape[1])
        )

        def layer(p, x, layer_cache):
            a, layer_cache = _old_decode(p["attn"], layer_norm.apply(p["ln_1"], x), layer_cache, config.attention)
            x = x + a
            return x + mlp.apply(p["mlp"], layer_norm.apply(p["ln_2"], x), activation=config.activation), layer_cache

        x, cache = stack.scan(layer, params["blocks"], x, xs=cache)
        return embedding.attend(params["wte"], layer_norm.apply(params["ln_f"], x)[:, -1]), cache

    def step(carry, _):
        logits, cache = carry
        new = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return hidden(cache, new[:, None]), new

    _, new = jax.lax.scan(step, hidden(cache, prompt), None, length=max_new_tokens)
    return jnp.concatenate([prompt, new.T], axis=1)


def _old_decode(params, x, cache, config):
    """The previous attention_cache.decode: keys and values (batch, max_len, n_kv_head, head_dim), which the
    attention's products transpose at every step, and one index for all rows."""
    q, k, v = attention.qkv_heads(params, x, config)
    batch, seq, n_head, _ = q.shape
    start = (0, cache["index"], 0, 0)
    k, v = (jax.lax.dynamic_update_slice(cache[name], new, start) for name, new in (("k", k), ("v", v)))
    q_pos, kv_pos = cache["index"] + jnp.arange(seq), jnp.arange(k.shape[1])
    written = kv_pos < cache["index"] + seq
    allowed = attention.combine_masks(None, config, n_head, q_pos, kv_pos, batch=batch, written=written)
    out = attention.attend(q, k, v, allowed, config)
    return linear.apply(params["proj"], out.reshape(batch, seq, -1)), {"k": k, "v": v, "index": cache["index"] + seq}


def recompute_generate(params, prompt, config, max_new_tokens):
    """nanoGPT's generate (greedy): the whole context forward for every token, one jitted call per token.
    The context is right-padded to the next multiple of 32 (so 32 contexts share one compiled program; the
    causal mask keeps the padding out of every real position) and the last real position is read."""
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
    return jnp.argmax(embedding.attend(params["wte"], h[:, last]), axis=-1).astype(jnp.int32)


def step_bytes(params, config, batch) -> tuple[int, int]:
    """(param bytes, cache bytes) a cached step reads: every parameter, and every layer's keys and values for
    block_size positions. `params` may be shapes (`jax.eval_shape`)."""
    param_bytes = sum(a.size * a.dtype.itemsize for a in tree_lib.flatten(params).values())
    cache = jax.eval_shape(lambda: gpt_decode.init_cache(config, batch))
    cache_bytes = sum(a.size * a.dtype.itemsize for a in cache["k"] + cache["v"])
    return param_bytes, cache_bytes


def step_flops(params, config, batch) -> tuple[int, int]:
    """(weight FLOPs, attention FLOPs) of a cached step of one token per row, counting the matrix products
    (2 per multiply-add; what they leave out, the norms, softmax and GELU, is about 3% more): each row's token
    times every weight matrix (the blocks' `w`s and the tied head, `wte`; `wpe` is a lookup), and each layer's
    query against every key and its probabilities against every value, over all block_size slots, masked
    ones included, as the step computes them. A dense GPT (a mixture of experts runs fewer weights)."""
    weights = sum(a.size for path, a in tree_lib.flatten(params).items() if path.endswith(".w") and path != "wpe.w")
    attention = 2 * 2 * config.n_layer * config.n_head * config.attention.head_dim * config.block_size
    return 2 * batch * weights, batch * attention


def xla_flops(params, config, batch) -> float:
    """FLOPs of the compiled `decode_step` (one token per row), as XLA's cost analysis counts them: the check
    on `step_flops`."""
    cache, idx = gpt_decode.init_cache(config, batch), jnp.zeros((batch, 1), jnp.int32)
    return tree_lib.flops(lambda p, c, i: gpt_decode.decode_step(p, c, i, config), params, cache, idx)


def measure(params, config, batch, prompt_len, repeats):
    """Median seconds per decoding step, (new, old), and whether both produce the same tokens."""
    prompt = jnp.asarray(np.random.default_rng(batch).integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
    n = config.block_size - prompt_len
    key = jax.random.key(1)

    def new(tokens):
        return lambda: gpt_decode.generate(params, prompt, config, key=key, max_new_tokens=tokens, temperature=0.0)

    def old(tokens):
        return lambda: old_generate(params, prompt, config, tokens)

    same = bool((np.asarray(new(n)()) == np.asarray(old(n)())).all())
    t = timing.interleaved_medians([new(n), new(2), old(n), old(2)], (), repeats, iters=1)
    return (t[0] - t[1]) / (n - 2), (t[2] - t[3]) / (n - 2), same


def compare_recompute(params, config, prompt_len, repeats):
    """Seconds of the whole generation, cached and recomputing, at batch 1 (the first call compiles)."""
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, prompt_len)), jnp.int32)
    n = config.block_size - prompt_len
    cached = gpt_decode.generate(params, prompt, config, key=jax.random.key(1), max_new_tokens=n, temperature=0.0)
    recompute_generate(params, prompt, config, n)  # compiles every bucket
    times = {"cached": [], "recompute": []}
    for _ in range(repeats):
        for name, fn in (("cached", gpt_decode.generate), ("recompute", None)):
            start = time.perf_counter()
            if fn is None:
                out = recompute_generate(params, prompt, config, n)
            else:
                out = jax.block_until_ready(
                    fn(params, prompt, config, key=jax.random.key(1), max_new_tokens=n, temperature=0.0)
                )
            times[name].append(time.perf_counter() - start)
    agree = float(np.mean(np.asarray(cached) == np.asarray(out)))
    return statistics.median(times["cached"]), statistics.median(times["recompute"]), agree


def machine_rates() -> tuple[float, float]:
    """(read bandwidth in bytes/s, matmul rate in FLOP/s), printed: the best of bench/membw.py's reads and of
    three float32 matmul rates (`bench.timing.measure_matmul_flops`, 1024^3 under jit)."""
    bandwidth = membw.bandwidths()
    rates = [timing.measure_matmul_flops() for _ in range(3)]
    print("memory bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items()))
    print("float32 matmul rate (1024^3): " + ", ".join(f"{r / 1e9:.0f}" for r in rates) + " GFLOP/s")
    return max(bandwidth["xla read"], bandwidth["numpy read"]) * 1e9, max(rates)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--recompute", action="store_true", help="also time nanoGPT's recomputing loop (slow)")
    args = parser.parse_args(argv)

    config = gpt.GPTConfig(block_size=args.block, vocab_size=65, n_layer=6, n_head=6, n_embd=384)
    params = jax.jit(gpt.init, static_argnames="config")(jax.random.key(0), config)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, load average {os.getloadavg()[0]:.1f}, {config}")
    read, rate = machine_rates()
    print(f"prompt {args.prompt}, {args.block - args.prompt} new tokens, greedy; per-step medians of {args.repeats}")
    print(
        f"{'batch':>5s} {'MB read':>8s} {'floor ms':>9s} {'MFLOP':>6s} {'compute ms':>11s} {'step ms':>8s} "
        f"{'x floor':>8s} {'x roof':>7s} {'tokens/s':>9s} {'before ms':>10s} {'x floor':>8s} {'tokens/s':>9s} "
        f"{'same':>5s}"
    )
    for batch in args.batches:
        nbytes, flops = sum(step_bytes(params, config, batch)), sum(step_flops(params, config, batch))
        floor, compute = nbytes / read, flops / rate
        new, old, same = measure(params, config, batch, args.prompt, args.repeats)
        row = f"{batch:5d} {nbytes / 1e6:8.1f} {floor * 1e3:9.2f} {flops / 1e6:6.0f} {compute * 1e3:11.2f} "
        row += f"{new * 1e3:8.2f} {new / floor:8.2f} {new / max(floor, compute):7.2f} {batch / new:9.0f} "
        print(row + f"{old * 1e3:10.2f} {old / floor:8.2f} {batch / old:9.0f} {str(same):>5s}")
    for batch in args.batches:
        weights, attention = step_flops(params, config, batch)
        print(
            f"batch {batch}: {(weights + attention) / 1e6:.1f} MFLOP per step ({weights / 1e6:.1f} weights, "
            f"{attention / 1e6:.1f} attention), XLA's cost analysis {xla_flops(params, config, batch) / 1e6:.1f}"
        )
    if args.recompute:
        cached, recompute, agree = compare_recompute(params, config, args.prompt, min(args.repeats, 3))
        n = args.block - args.prompt
        print(
            f"batch 1, whole generation: cached {cached:.3f} s ({n / cached:.0f} tokens/s), nanoGPT's recompute "
            f"{recompute:.3f} s ({n / recompute:.0f} tokens/s), {recompute / cached:.1f}x; tokens equal {agree:.0%}"
        )


if __name__ == "__main__":
    main()
