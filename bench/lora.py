"""A LoRA training step against a full fine-tune at the same shape: XLA's compiled memory and the step time.

    python -m bench.lora [--n_layer 12 --n_embd 768 --n_head 12 --batch 4 --seq 1024] [--time_batch 1 --time_seq 128]
                         [--repeats 3] [--rank 8]

Contenders, every one the same GPT-2-small-shaped model (bias, tanh GELU, vocab 50304), AdamW, clipping at 1.0,
float32 compute (unless named), one `optim.train_step` jitted with the state donated, as the programs build it:

    full           every parameter trains: params, gradients and AdamW's two moments all of the model's size
    lora-merge     purejax.lora as train.finetune runs it: `lora.frozen` merges W + scale * A @ B inside the
                   loss, the model's own `gpt.loss` runs on the merged params (the default; no layer changes)
    lora-merge-bf  the same with the frozen base held in bfloat16 (the adapters and their state float32)
    lora-merge-bf-bf  that, computing in bfloat16 too (train.finetune --base_dtype=bfloat16 --dtype=bfloat16)
    lora-lowrank   x @ W + scale * (x @ A) @ B, never forming W + scale * A @ B: the adapted weights are
                   replaced by a `LowRank` pytree whose `__rmatmul__` computes that, which purejax.nn.linear's
                   `rows @ w` calls. Outside the layer contract (params are dicts of arrays; the runtime type
                   checks of the test suite reject it), so it lives here, not in purejax.lora: docs/lora.md

LoRA targets `blocks.attn.qkv.w` and `blocks.mlp.*.w` (rank 8, alpha 16). Memory is XLA's
`compiled.memory_analysis()` for the (batch, seq) of `--batch --seq` (compiled, not run): arguments (state,
base, batch), temporaries, and their sum less what donation aliases. The time is the median of `--repeats`
interleaved steps at the smaller `--time_batch --time_seq`, so that a CPU finishes. Before timing, the first
step's losses are checked to agree (B = 0: every contender is the base model).
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import gpt
from purejax import lora, optim
from purejax import tree as tree_lib
from purejax.precision import Policy, with_policy

TARGETS = ("blocks.attn.qkv.w", "blocks.mlp.*.w")


@jax.tree_util.register_pytree_node_class
class LowRank:
    """A weight W with its adapter, multiplied as x @ W + scale * (x @ A) @ B: the low-rank path. `shape` and
    `dtype` are W's, so the layers' shape checks read it as the weight; the scale is static (aux data)."""

    def __init__(self, w, a, b, scale):
        self.w, self.a, self.b, self.scale = w, a, b, scale

    shape = property(lambda self: self.w.shape)
    dtype = property(lambda self: self.w.dtype)

    def __rmatmul__(self, x):
        return x @ self.w.astype(x.dtype) + self.scale * ((x @ self.a.astype(x.dtype)) @ self.b.astype(x.dtype))

    def tree_flatten(self):
        return (self.w, self.a, self.b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale)


def low_rank(base, adapters, config: lora.LoraConfig):
    """`base` with each adapted weight replaced by its LowRank pair (what `lora.merge` is to the merged path)."""
    flat = tree_lib.flatten(base)
    for path, (w, ab) in lora.adapted(base, adapters, config).items():
        flat[path] = LowRank(w, ab["a"], ab["b"], config.scale)
    return tree_lib.unflatten_like(base, flat)


def contenders(model: gpt.GPTConfig, config: lora.LoraConfig, params):
    """{name: (step(state, batch, base), state, base)}: each a jitted train step with its donated state."""
    optimizer = optim.adamw(1e-4, weight_decay=0.0)
    adapters = lora.init(jax.random.key(1), params, config)

    def loss_in(compute):
        return with_policy(functools.partial(gpt.loss, config=model), Policy(jnp.float32, compute, jnp.float32))

    loss, loss_bf16 = loss_in(jnp.float32), loss_in(jnp.bfloat16)

    def make(loss_of, trainable):
        def step(state, batch, base):
            loss_fn = lambda p, batch, key: (loss_of(p, base, batch), {})  # noqa: E731
            return optim.train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0)

        trainable = jax.tree.map(jnp.copy, trainable)  # its own arrays: the step donates them
        return jax.jit(step, donate_argnums=0), optim.init_train_state(trainable, optimizer, jax.random.key(2))

    merged = lambda a, base, batch: lora.frozen(loss, base, config)(a, batch)  # noqa: E731
    merged_bf16 = lambda a, base, batch: lora.frozen(loss_bf16, base, config)(a, batch)  # noqa: E731
    lowrank = lambda a, base, batch: loss(low_rank(jax.lax.stop_gradient(base), a, config), batch)  # noqa: E731
    bf16 = tree_lib.cast_floating(params, jnp.bfloat16)
    return {
        "full": (*make(lambda p, base, batch: loss(p, batch), params), {}),
        "lora-merge": (*make(merged, adapters), params),
        "lora-merge-bf": (*make(merged, adapters), bf16),
        "lora-merge-bf-bf": (*make(merged_bf16, adapters), bf16),
        "lora-lowrank": (*make(lowrank, adapters), params),
    }


def memory(step, state, base, batch) -> dict[str, float]:
    """MB of the compiled step's arguments, temporaries and peak (arguments + outputs + temporaries - aliased)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch, base))
    start = time.perf_counter()
    m = step.lower(*shapes).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {
        "arguments": m.argument_size_in_bytes / 1e6,
        "temporaries": m.temp_size_in_bytes / 1e6,
        "peak": peak / 1e6,
        "compile_s": time.perf_counter() - start,
    }


def batch_of(model, batch, seq, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, model.vocab_size)
    return ids[:, :-1], ids[:, 1:]


def timings(cases, batch, repeats: int) -> dict[str, float]:
    """Median ms per step, the contenders interleaved (round 0 compiles and is dropped; the order alternates)."""
    times = {name: [] for name in cases}
    states = {name: state for name, (_, state, _) in cases.items()}
    first = {}
    for round_ in range(repeats + 1):
        for name in list(cases) if round_ % 2 else list(cases)[::-1]:
            step, _, base = cases[name]
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch, base)
            jax.block_until_ready(metrics["loss"])
            times[name].append(time.perf_counter() - start)
            first.setdefault(name, float(metrics["loss"]))
    for name, value in first.items():  # the bfloat16 base is the float32 one rounded: a looser tolerance
        assert np.isclose(value, first["full"], rtol=2e-2 if "-bf" in name else 1e-5), first
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("n_layer", 12),
        ("n_head", 12),
        ("n_embd", 768),
        ("batch", 4),
        ("seq", 1024),
        ("time_batch", 1),
        ("time_seq", 128),
        ("repeats", 3),
        ("rank", 8),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    model = gpt.GPTConfig(
        block_size=args.seq,
        vocab_size=50304,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        bias=True,
        gelu="tanh",
    )
    config = lora.LoraConfig(targets=TARGETS, rank=args.rank, alpha=2.0 * args.rank)
    params = gpt.init(jax.random.key(0), model)
    cases = contenders(model, config, params)
    device = jax.devices()[0]
    print(
        f"GPT {args.n_layer}x{args.n_embd} ({tree_lib.count(params) / 1e6:.1f}M params), LoRA {TARGETS} rank "
        f"{args.rank} ({tree_lib.count(cases['lora-merge'][1].params) / 1e6:.2f}M), {device.platform} "
        f"({device.device_kind}), jax {jax.__version__}\n"
    )
    big = batch_of(model, args.batch, args.seq)
    rows = {name: memory(step, state, base, big) for name, (step, state, base) in cases.items()}
    ms = timings(cases, batch_of(model, args.time_batch, args.time_seq), args.repeats)
    print(
        f"| step | trainable state MB | arguments MB | temporaries MB | peak MB (batch {args.batch}x{args.seq}) "
        f"| peak / full | ms per step ({args.time_batch}x{args.time_seq}) | time / full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (_, state, _) in cases.items():
        r, trainable = rows[name], tree_lib.nbytes((state.params, state.opt_state)) / 1e6
        print(
            f"| {name} | {trainable:,.1f} | {r['arguments']:,.0f} | {r['temporaries']:,.0f} | {r['peak']:,.0f} | "
            f"{r['peak'] / rows['full']['peak']:.2f} | {ms[name]:,.0f} | {ms[name] / ms['full']:.2f} |"
        )


if __name__ == "__main__":
    main()
