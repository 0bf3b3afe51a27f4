"""Where a cached decoding step's time goes, kernel by kernel, and the bound each kernel is held against.

    python -m bench.gpt_generate_profile --batch 8       # bench/gpt_generate.py's model, block 256
    python -m bench.gpt_generate_profile --batch 1 --top 8

bench/gpt_generate.py times `generate` against the step's floor: every weight and the whole cache read once,
at the machine's read bandwidth. This takes one compiled `gpt_decode.decode_step` (one token per row, the cache
of block_size slots) apart: a `jax.profiler` trace gives each XLA:CPU kernel's busy time (its thunk events),
the optimized HLO gives what each kernel reads and writes (its operands and result, in bytes) and, for a matrix
product, its FLOPs. Each kernel's bound is the larger of bytes / read bandwidth and FLOPs / matmul rate (both
measured in the same run, as bench/gpt_generate.py measures them); "x bound" is its time over that bound. A
kernel that touches a few slots of the cache in place (a scatter of each row's new keys or values, a slice) is
charged the slots, not the cache around them.

Kernels are grouped by what they compute: the weights' products, the attention's products with the cached
keys and values, the cache's in-place writes and slices, and the rest (norms, GELU, softmax, residual adds,
the sampling's glue).
The profile is of `generate` itself (the loop that writes the cache in place), per decoding step: its loop
body's kernels, over whole generations.
"""

import argparse
import collections
import dataclasses
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpt_anatomy_hlo import parse_hlo
from bench.gpt_anatomy_profile import thunk_events
from bench.gpt_generate import machine_rates
from models import gpt, gpt_decode

_ARRAY = re.compile(r"\b(pred|bf16|[subf]\d+)\[([\d,]*)\]")
_OPERANDS = re.compile(r" [a-z][\w-]*\(([^)]*)\)")


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape: `f32[8,384]{1,0}`, or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 16)
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
    return total


@dataclasses.dataclass
class Kernel:
    """One kernel of the step: its HLO name and opcode, what it does, bytes in and out, FLOPs, busy ms."""

    name: str
    opcode: str
    group: str
    nbytes: int
    flops: int
    ms: float = 0.0

    def bound_ms(self, read: float, rate: float) -> float:
        return max(self.nbytes / read, self.flops / rate) * 1e3


def _dots(instr, hlo) -> list:
    """The dot instructions a kernel runs: itself, or those of the computation a fusion calls."""
    if instr.opcode == "dot":
        return [instr]
    called = re.search(r"calls=%([\w.-]+)", instr.line)
    return [i for i in hlo.values() if called and i.computation == called.group(1) and i.opcode == "dot"]


def dot_flops(dot, hlo) -> int:
    """2 x the result's elements x the contracted size, read off the dot's operand shape and dims."""
    lhs = re.search(r" dot\(%([\w.-]+),", dot.line).group(1)
    lhs_dims = [int(d) for d in _ARRAY.search(hlo[lhs].shape).group(2).split(",") if d]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.line).group(1)
    k = int(np.prod([lhs_dims[int(d)] for d in contracting.split(",") if d]))
    result = [int(d) for d in _ARRAY.search(dot.shape).group(2).split(",") if d]
    return 2 * int(np.prod(result)) * k


class CacheShape(NamedTuple):
    """What marks one layer's cached keys (or values) in the HLO, however XLA reshapes them: their element
    count, with the slots and the head width among the dimensions (the position table, [block, n_embd], can
    have the same count at batch 1)."""

    elements: int
    slots: int
    head_dim: int

    def matches(self, shape: str) -> bool:
        m = _ARRAY.search(shape)
        sizes = [int(d) for d in m.group(2).split(",") if d] if m else []
        return int(np.prod(sizes)) == self.elements and {self.slots, self.head_dim} <= set(sizes)


def _operands(instr, hlo) -> list:
    """The instructions `instr` reads (its operand list's %names; XLA's /*index=N*/ comments skipped)."""
    return [hlo[name] for name in re.findall(r"%([\w.-]+)", _OPERANDS.search(instr.line).group(1)) if name in hlo]


def group_of(instr, hlo, dots: list, cache: CacheShape) -> str:
    """What a kernel computes: "cache in place" (a scatter, dynamic-update-slice or dynamic-slice of the cache:
    it touches a few slots of it), "attention" (it
    reads an array of one layer's cache keys or values: the products with the keys and the values), "weights" (a
    product with a weight matrix), or "other" (norms, GELU, softmax, residual adds, the sampling's glue)."""
    body = re.search(r"calls=%([\w.-]+)", instr.line)
    inner = {i.opcode for i in hlo.values() if body and i.computation == body.group(1)}
    reads_cache = any(cache.matches(o.shape) for o in _operands(instr, hlo))
    if reads_cache and {"scatter", "dynamic-update-slice", "dynamic-slice"} & (inner | {instr.opcode}):
        return "cache in place"
    if reads_cache:
        return "attention"
    return "weights" if dots else "other"


def loop_body(hlo_text: str) -> str:
    """The name of the decoding loop's body: the computation of the largest while loop."""
    hlo = parse_hlo(hlo_text)
    bodies = re.findall(r"body=%([\w.-]+)", hlo_text)
    return max(bodies, key=lambda body: sum(i.computation == body for i in hlo.values()))


def kernels(hlo_text: str, cache: CacheShape) -> dict[str, Kernel]:
    """Every kernel one decoding step runs (the loop body's instructions, not those inside fusions), by name."""
    hlo = parse_hlo(hlo_text)
    entry = loop_body(hlo_text)
    skip = ("parameter", "tuple", "get-tuple-element", "constant", "bitcast")
    out = {}
    for instr in hlo.values():
        if instr.computation != entry or instr.opcode in skip:
            continue
        dots = _dots(instr, hlo)
        group = group_of(instr, hlo, dots, cache)
        arrays = [instr.shape, *(o.shape for o in _operands(instr, hlo))]
        if group == "cache in place":  # the slots written or read and their indices move, not the whole cache
            arrays = [a for a in arrays if not cache.matches(a)]
        nbytes = sum(array_bytes(a) for a in arrays)
        out[instr.name] = Kernel(instr.name, instr.opcode, group, nbytes, sum(dot_flops(d, hlo) for d in dots))
    return out


def profile(call, table: dict[str, Kernel], calls: int, steps: int) -> float:
    """Fill each kernel's busy ms per decoding step from a trace of `calls` calls of `steps` steps each;
    returns the traced wall ms per step (the prefill included, a few percent)."""
    wall, events = thunk_events(call, calls)
    for name, ms in events:
        if name in table:
            table[name].ms += ms / (calls * steps)
    return wall / steps * 1e3


def generate_program(config: gpt.GPTConfig, batch: int, prompt_len: int):
    """(call, optimized HLO text, the `CacheShape` of one layer's cached keys, decoding steps per call) of
    greedy `generate`: prompts of `prompt_len` tokens, then new tokens to the end of the block, the cache
    written in place inside the loop."""
    block = config.block_size
    params = jax.jit(gpt.init, static_argnames="config")(jax.random.key(0), config)
    prompt = jnp.asarray(np.random.default_rng(batch).integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
    steps = block - prompt_len

    def run(params, prompt):
        return gpt_decode.generate(params, prompt, config, key=jax.random.key(1), max_new_tokens=steps, temperature=0.0)

    compiled = jax.jit(run).lower(params, prompt).compile()
    keys = gpt_decode.init_cache(config, batch)["k"][0]
    cache = CacheShape(keys.size, block, config.attention.head_dim)
    return (lambda: compiled(params, prompt)), compiled.as_text(), cache, steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3, help="whole generations traced")
    parser.add_argument("--top", type=int, default=10, help="the slowest kernels listed one by one")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, load average {os.getloadavg()[0]:.1f}; batch {args.batch}, block {args.block}")
    read, rate = machine_rates()
    config = gpt.GPTConfig(block_size=args.block, vocab_size=65, n_layer=6, n_head=6, n_embd=384)  # gpt_generate's
    call, hlo_text, cache, steps = generate_program(config, args.batch, args.prompt)
    table = kernels(hlo_text, cache)
    wall = profile(call, table, args.calls, steps)
    busy = sum(k.ms for k in table.values())
    print(f"a decoding step under the trace: {wall:.2f} ms wall, {busy:.2f} ms busy in {len(table)} kernels")
    groups = collections.defaultdict(list)
    for k in table.values():
        groups[k.group].append(k)
    print("| group | kernels | busy ms | MB | MFLOP | bound ms | x bound |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for group, ks in sorted(groups.items(), key=lambda g: -sum(k.ms for k in g[1])):
        ms, bound = sum(k.ms for k in ks), sum(k.bound_ms(read, rate) for k in ks)
        mb, mflop = sum(k.nbytes for k in ks) / 1e6, sum(k.flops for k in ks) / 1e6
        print(f"| {group} | {len(ks)} | {ms:.2f} | {mb:.1f} | {mflop:.1f} | {bound:.2f} | {ms / bound:.1f} |")
    print(f"\nthe {args.top} slowest kernels:")
    print("| kernel | group | busy ms | MB | GB/s | GFLOP/s | x bound |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for k in sorted(table.values(), key=lambda k: -k.ms)[: args.top]:
        seconds = max(k.ms, 1e-6) / 1e3
        gbs, gflops = k.nbytes / seconds / 1e9, k.flops / seconds / 1e9
        print(
            f"| {k.name} ({k.opcode}) | {k.group} | {k.ms:.3f} | {k.nbytes / 1e6:.2f} | {gbs:.1f} | {gflops:.1f} | "
            f"{k.ms / k.bound_ms(read, rate):.1f} |"
        )


if __name__ == "__main__":
    main()
