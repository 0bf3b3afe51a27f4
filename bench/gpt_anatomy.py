"""Where the GPT training step of bench/gpt_train.py spends its time on XLA:CPU, measured (issue 5).

    python -m bench.gpt_anatomy [--configs baby,small] [--sections profile,dots,attention,step,flags]

Sections (each prints a markdown table; docs/benchmarks.md records them):
    profile    purejax, raw JAX and NNX (split mode) side by side: the step time (interleaved medians), then one
               profiled step per contender (jax.profiler, XLA:CPU's per-thunk trace events) with the busy time
               by kind of kernel: matmuls (YNNPACK fusions and Eigen dots), layout changes (fusions whose output
               is a transpose, copies), other elementwise/reduction fusions; and from the optimized HLO the
               number of transposes and copies and the bytes they write.
    dots       every dot of purejax's optimized step HLO (shapes, contracting dims and the physical layouts
               they are stored in), timed as a standalone jitted dot and as the same product in PyTorch
               (2 threads), times how often the step runs it; against the profiled time of the step's matmuls.
    attention  purejax with `jax.nn.dot_product_attention` ("fused") against the einsum formulation.
    step       forward only, forward + backward and the full step, purejax against NNX split; and purejax's
               step without donation, with the optimizer as one fused tree_map, with the layer scan unrolled,
               and with the matmuls in their former 3-D form (`x @ w` on (batch, seq, d) activations, before
               this investigation moved purejax to purejax/nn/_matmul.py's row form).
    flags      the XLA:CPU flags this jaxlib knows (strings of libjax_common.so), and the purejax step timed in
               a subprocess under each promising one (XLA_FLAGS is read once, when the backend starts), with the
               loss after two steps, to see whether a flag changes the numerics.

Timings share the machine with other jobs: each table reports the load average; compare ratios within one
table, not absolute times across runs. The default run (baby and small, every section) takes about 8 minutes.
"""

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench import gpt_train
from bench.timing import interleaved_medians
from purejax import optim
from purejax.models import gpt
from purejax.precision import Policy
from purejax.train import gpt as train_gpt

CONFIGS = ("tiny", "baby", "small")
SECTIONS = ("profile", "dots", "attention", "step", "flags")


# ---------------------------------------------------------------- the optimized HLO of a step

# XLA writes the optimized HLO of every module whose name matches to this folder, when XLA_FLAGS asks before the
# backend starts (main does). The contenders of bench/gpt_train.py jit functions named *step*.
# A flags-section worker inherits its parent's folder through XLA_FLAGS.
_inherited = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
HLO_DUMP = _inherited.group(1) if _inherited else os.path.join(tempfile.gettempdir(), f"gpt_anatomy_hlo_{os.getpid()}")
DUMP_FLAGS = f"--xla_dump_to={HLO_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*"


def build_with_hlo(make, *args):
    """`make(*args)` and one call of the step it returns (compiling it), and the optimized HLO that compiled:
    the largest module XLA dumped meanwhile (by modification time: a later process reuses the file names).
    Returns (step, hlo text)."""
    start = time.time()
    step = make(*args)
    jax.block_until_ready(step())
    dumped = glob.glob(os.path.join(HLO_DUMP, "*after_optimizations.txt"))
    new = sorted((p for p in dumped if os.path.getmtime(p) >= start), key=os.path.getsize)
    if not new:
        raise RuntimeError(f"no optimized HLO was dumped to {HLO_DUMP}: is XLA_FLAGS missing {DUMP_FLAGS!r}?")
    with open(new[-1]) as f:
        return step, f.read()


@dataclasses.dataclass
class Instr:
    """One HLO instruction: its name, opcode, result shape text, and the computation it sits in."""

    name: str
    opcode: str
    shape: str
    computation: str
    line: str


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.+?) ([a-z][\w-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) ")


def parse_hlo(text: str) -> dict[str, Instr]:
    """Every instruction of an HLO module by name."""
    out, computation = {}, None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            computation = m.group(1)
        elif m := _INSTR.match(line):
            out[m.group(1)] = Instr(m.group(1), m.group(3), m.group(2), computation, line)
    return out


def _called(instr: Instr) -> str | None:
    m = re.search(r"calls=%([\w.-]+)", instr.line)
    return m.group(1) if m else None


def _nbytes(shape: str) -> int:
    """Bytes of an array shape like `f32[12,64,512]{2,1,0}` (0 for tuples and tokens)."""
    m = re.match(r"(pred|[subf]\d+|bf16)\[([\d,]*)\]", shape)
    if not m:
        return 0
    bits = 8 if m.group(1) == "pred" else int(re.sub(r"\D", "", m.group(1)) or 16)
    return int(np.prod([int(d) for d in m.group(2).split(",") if d], dtype=np.int64)) * bits // 8


def kind_of(name: str, hlo: dict[str, Instr]) -> str | None:
    """What a thunk named `name` does: "matmul (YNNPACK)", "matmul (Eigen)", "layout change" (a copy, a
    transpose, or a fusion whose result is written transposed), "reduction (YNNPACK)", "elementwise fusion",
    "other"; None for control flow (while, call) and names that are not instructions (executor events)."""
    instr = hlo.get(name)
    if instr is None or instr.opcode in ("while", "call", "conditional", "parameter", "tuple", "get-tuple-element"):
        return None
    if instr.opcode == "dot":
        return "matmul (Eigen)"
    if instr.opcode in ("copy", "transpose"):
        return "layout change"
    if instr.opcode == "fusion":
        body = [i for i in hlo.values() if i.computation == _called(instr)]
        ops = {i.opcode for i in body}
        if '"__ynn_fusion"' in instr.line:
            return "matmul (YNNPACK)" if "dot" in ops else "reduction (YNNPACK)"
        if "dot" in ops:
            return "matmul (Eigen)"
        if ops & {"transpose", "copy"}:
            return "layout change"
        return "elementwise fusion"
    return "other"


def movement(hlo_text: str) -> dict[str, tuple[int, int]]:
    """(count, bytes written) of the data-movement instructions in the optimized HLO: copies and transposes
    that run on their own, and fusions that contain a transpose or copy (their whole result is written in a
    new layout). Instructions inside a while body count once, not once per iteration."""
    hlo = parse_hlo(hlo_text)
    out = collections.defaultdict(lambda: [0, 0])
    fused = {c for i in hlo.values() if i.opcode == "fusion" for c in [_called(i)]}
    for instr in hlo.values():
        if instr.computation in fused:
            continue
        k = kind_of(instr.name, hlo)
        if k == "layout change":
            label = instr.opcode if instr.opcode != "fusion" else "fusion writing a transpose/copy"
            out[label][0] += 1
            out[label][1] += _nbytes(instr.shape)
    return {k: tuple(v) for k, v in out.items()}


# ---------------------------------------------------------------- profiling one step


def profile(step, hlo_text: str, steps: int = 3) -> dict[str, float]:
    """Busy milliseconds per step by kind of kernel (`kind_of`), from XLA:CPU's per-thunk trace events, and
    "wall" (ms per step under the profiler) and "thunks" (kernels run per step). Busy time sums over threads:
    with two worker threads it can exceed the wall time."""
    hlo = parse_hlo(hlo_text)
    jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(step())
            wall = (time.perf_counter() - start) / steps
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    busy = collections.Counter()
    thunks = 0
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's worker threads and the client thread that runs thunks
                continue
            for event in line.events:
                kind = kind_of(event.name, hlo)
                if kind is not None:
                    busy[kind] += event.duration_ns / 1e6 / steps
                    thunks += 1
    return {**busy, "wall": wall * 1e3, "thunks": thunks / steps}


# ---------------------------------------------------------------- the contenders and the prototypes


@dataclasses.dataclass(frozen=True)
class Setup:
    """A config's model, the shared initial weights (purejax's layout, numpy) and the batch."""

    name: str
    case: gpt_train.Case
    weights: dict
    x: np.ndarray
    y: np.ndarray

    @classmethod
    def make(cls, name: str) -> "Setup":
        case = gpt_train.CASES[name]
        config = case.model
        weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
        data = np.random.default_rng(0).integers(0, config.vocab_size, (case.batch, config.block_size + 1), np.int32)
        return cls(name, case, weights, data[:, :-1], data[:, 1:])

    def build(self, make, **config_changes):
        """`make(weights, config, x, y)` as bench/gpt_train.py's makers take them, with the config changed."""
        return make(self.weights, dataclasses.replace(self.case.model, **config_changes), self.x, self.y)


def _linear_3d(params, x, *, axis_name=None):
    """purejax.nn.linear.apply as it was before this investigation: `x @ w` on the 3-D activations.

    Same maths as today's `matmul_rows` form (purejax/nn/_matmul.py). Why it mattered: differentiating `x @ w`
    for a 3-D x, JAX writes the weight gradient as dot_general(g, x) contracting (batch, seq), then a
    transpose; XLA:CPU folds that transpose into the producer of g (the GELU or residual backward fusion),
    which then writes its whole output transposed, a strided store that runs 10-50x slower than the same
    fusion written in order. Kept here as the "before" of the comparison."""
    assert axis_name is None, "the comparison covers the single-device model"
    y = x @ params["w"]
    return y + params["b"] if "b" in params else y


def _attend_3d(params, x):
    """purejax.nn.embedding.attend (the tied head) as it was before: `x @ table.T` on the 3-D activations."""
    return x @ params["w"].T


class variant:
    """Within this context, purejax's linear layers and tied head use the 3-D form they had before this
    investigation (`matmuls_3d`), and `purejax.nn.stack.scan` gets a `lax.scan` unroll (`unroll`). Only
    tracing sees the change: a step traced inside keeps it when it runs outside (`traced_in`)."""

    def __init__(self, matmuls_3d: bool = False, unroll: int | bool = 1):
        self.matmuls_3d, self.unroll = matmuls_3d, unroll

    def __enter__(self):
        from purejax.nn import embedding, linear, stack

        self.saved = linear.apply, embedding.attend, stack.scan
        if self.matmuls_3d:
            linear.apply, embedding.attend = _linear_3d, _attend_3d
        stack.scan = partial(stack.scan, unroll=self.unroll)

    def __exit__(self, *exc):
        from purejax.nn import embedding, linear, stack

        linear.apply, embedding.attend, stack.scan = self.saved


def traced_in(step, **changes):
    """`step` whose first call (the one that traces and compiles it) runs inside `variant(**changes)`; later
    calls reuse that compilation."""
    traced = False

    def traced_step():
        nonlocal traced
        if traced:
            return step()
        traced = True
        with variant(**changes):
            return step()

    return traced_step


def make_purejax_3d(weights, config, x, y, unroll: int | bool = 1):
    """gpt_train's purejax step with the matmuls in their former 3-D form."""
    return traced_in(gpt_train.make_purejax(weights, config, x, y), matmuls_3d=True, unroll=unroll)


def make_purejax_unrolled(weights, config, x, y):
    """gpt_train's purejax step with the layer scan fully unrolled."""
    return traced_in(gpt_train.make_purejax(weights, config, x, y), unroll=True)


def fused_adamw(cfg: train_gpt.TrainConfig) -> optim.GradientTransformation:
    """purejax/train/gpt.py's AdamW (warmup-cosine rate, decay on `train_gpt.decays`) written as ONE tree_map over
    (grad, mu, nu, param) instead of the chain adam -> weight decay -> learning rate: the comparison for
    "does chaining transforms cost anything once XLA has fused the step?"."""
    from purejax.optim.weight_decay import resolve_mask

    schedule = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)
    b1, b2, eps, wd = cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params):
        count = state["count"] + 1
        lr = schedule(state["count"])
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)

        def leaf(g, m, v, p, decay):
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * jnp.square(g)
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return -lr * (u + wd * p if decay else u), m, v

        out = jax.tree.map(leaf, grads, state["mu"], state["nu"], params, resolve_mask(train_gpt.decays, params))
        pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=lambda t: isinstance(t, tuple))  # noqa: E731
        return pick(0), {"count": count, "mu": pick(1), "nu": pick(2)}

    return optim.GradientTransformation(init, update)


def make_purejax_variant(weights, config, x, y, *, donate=True, optimizer="chain"):
    """gpt_train.make_purejax with the donation and the optimizer's form as parameters."""
    tx = train_gpt.make_optimizer(gpt_train.TRAIN) if optimizer == "chain" else fused_adamw(gpt_train.TRAIN)
    return gpt_train.make_purejax(weights, config, x, y, optimizer=tx, donate=donate)


def make_purejax_part(weights, config, x, y, *, part):
    """purejax's loss alone ("fwd") or its gradient ("fwd+bwd"), jitted as train_step takes them."""
    loss_fn = train_gpt.make_loss_fn(config, Policy(jnp.float32, "float32", jnp.float32))
    params, batch, key = jax.tree.map(jnp.array, weights), (jnp.asarray(x), jnp.asarray(y)), jax.random.key(0)
    fn = (lambda p: loss_fn(p, batch, key)[0]) if part == "fwd" else jax.grad(lambda p: loss_fn(p, batch, key)[0])
    fn = jax.jit(fn)
    return lambda: fn(params)


def make_nnx_part(weights, config, x, y, *, part):
    """The NNX peer's loss alone or its gradient, split once and merged inside jax.jit (as `nnx-split`)."""
    from flax import nnx

    graphdef, state = nnx.split(gpt_train.nnx_model(weights, config))
    x, y = jnp.asarray(x), jnp.asarray(y)

    def loss(state):
        return gpt_train.xent(nnx.merge(graphdef, state)(x), y)

    fn = jax.jit(loss if part == "fwd" else jax.grad(loss))
    return lambda: fn(state)


# ---------------------------------------------------------------- the step's matmuls, one by one


@dataclasses.dataclass(frozen=True)
class Dot:
    """A dot of the optimized HLO in physical terms: each operand's dims in memory order (major to minor) and
    the positions, in those orders, of the contracting and batch dims. `runs`: times per step."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    contract: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    kernel: str  # "YNNPACK" or "Eigen"

    @property
    def flops(self) -> int:
        rhs_free = [d for i, d in enumerate(self.rhs) if i not in self.contract[1] + self.batch[1]]
        return 2 * int(np.prod([*self.lhs]) * np.prod(rhs_free or [1]))

    def describe(self) -> str:
        dims = lambda shape, c, b: ",".join(  # noqa: E731
            ("k" if i in c else "b" if i in b else "") + str(d) for i, d in enumerate(shape)
        )
        lhs = dims(self.lhs, self.contract[0], self.batch[0])
        return f"[{lhs}] x [{dims(self.rhs, self.contract[1], self.batch[1])}]"


def _dims(text: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", text)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _physical(shape: str) -> tuple[tuple[int, ...], list[int]]:
    """(dims in memory order, position in that order of each logical dim) of `f32[a,b]{1,0}`."""
    m = re.match(r"\w+\[([\d,]*)\](?:\{([\d,]*)\})?", shape)
    logical = [int(d) for d in m.group(1).split(",") if d]
    minor_to_major = [int(d) for d in m.group(2).split(",")] if m.group(2) else list(range(len(logical)))[::-1]
    order = minor_to_major[::-1]
    return tuple(logical[i] for i in order), [order.index(i) for i in range(len(logical))]


def step_dots(hlo_text: str, n_layer: int) -> collections.Counter:
    """Every dot of the optimized HLO as a `Dot`, counted per step (a dot in the scan's while body runs
    n_layer times)."""
    hlo = parse_hlo(hlo_text)
    ynn = {_called(i) for i in hlo.values() if i.opcode == "fusion" and '"__ynn_fusion"' in i.line}
    out = collections.Counter()
    for instr in hlo.values():
        if instr.opcode != "dot":
            continue
        operands = re.search(r" dot\(%([\w.-]+), %([\w.-]+)\)", instr.line).groups()
        (lhs, lpos), (rhs, rpos) = (_physical(hlo[o].shape) for o in operands)
        dot = Dot(lhs, rhs,
                  (tuple(lpos[d] for d in _dims(instr.line, "lhs_contracting_dims")),
                   tuple(rpos[d] for d in _dims(instr.line, "rhs_contracting_dims"))),
                  (tuple(lpos[d] for d in _dims(instr.line, "lhs_batch_dims")),
                   tuple(rpos[d] for d in _dims(instr.line, "rhs_batch_dims"))),
                  "YNNPACK" if instr.computation in ynn else "Eigen")  # fmt: skip
        out[dot] += n_layer if "while/body" in instr.line else 1
    return out


def _einsum_spec(dot: Dot) -> str:
    letters = iter("abcdefghijklmnop")
    lhs = [next(letters) for _ in dot.lhs]
    rhs = [next(letters) for _ in dot.rhs]
    for a, b in zip(dot.contract[0] + dot.batch[0], dot.contract[1] + dot.batch[1]):
        rhs[b] = lhs[a]
    out = [lhs[i] for i in dot.batch[0]]
    out += [c for i, c in enumerate(lhs) if i not in dot.contract[0] + dot.batch[0]]
    out += [c for i, c in enumerate(rhs) if i not in dot.contract[1] + dot.batch[1]]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def time_dots(dots, repeats: int) -> list[tuple[float, float]]:
    """(XLA seconds, torch seconds) per call of each dot: the jitted `lax.dot_general` on arrays stored as the
    step stores them, and `torch.einsum` of the same (2 threads; einsum hands the strided operands to its
    batched matmul, copying them only if it must), interleaved."""
    import torch

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    fns = []
    for dot in dots:
        a, b = (rng.standard_normal(s, np.float32) for s in (dot.lhs, dot.rhs))
        xla = jax.jit(partial(jax.lax.dot_general, dimension_numbers=(dot.contract, dot.batch)))
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        spec = _einsum_spec(dot)
        fns += [partial(xla, ja, jb), partial(torch.einsum, spec, ta, tb)]
    seconds = interleaved_medians(fns, (), repeats, sample_seconds=0.05)
    return list(zip(seconds[::2], seconds[1::2]))


def torch_profile(setup: Setup, steps: int = 3) -> dict[str, float]:
    """Milliseconds per step of PyTorch's eager step (bench/gpt_train.py's torch peer) in its matmul kernels
    (aten::mm, bmm, addmm), its attention kernel, and in total (the step's wall time under the profiler)."""
    events, wall = torch_profile_events(setup.build(gpt_train.make_torch), steps)
    out = collections.Counter()
    for event in events:
        if event.key in ("aten::mm", "aten::bmm", "aten::addmm"):
            out["matmul"] += event.self_cpu_time_total / 1e3 / steps
        elif "scaled_dot_product" in event.key:  # forward and backward kernels
            out["attention"] += event.self_cpu_time_total / 1e3 / steps
    return {**out, "wall": wall}


def torch_profile_events(step, steps: int):
    """(torch.profiler's key_averages over `steps` calls of `step` after one warm-up call, ms per step under the
    profiler)."""
    import torch

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    return prof.key_averages(), wall * 1e3


# ---------------------------------------------------------------- the sections


def _table(header, rows) -> None:
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(f"(load average {os.getloadavg()[0]:.1f})", flush=True)


def _medians(steps: dict, setup: Setup, repeats: int | None = None) -> dict[str, float]:
    """Interleaved median ms per step of each named step function, gpt_train's sampling for the config."""
    case = setup.case
    iters = None if case.sample_seconds else 1  # small: one step per sample
    seconds = interleaved_medians(list(steps.values()), (), repeats or case.repeats + 2, iters=iters,
                                  sample_seconds=case.sample_seconds or 0.05)  # fmt: skip
    return {name: s * 1e3 for name, s in zip(steps, seconds)}


KINDS = ("matmul (YNNPACK)", "matmul (Eigen)", "layout change", "elementwise fusion", "reduction (YNNPACK)", "other")
PROFILED = {
    "purejax-3d": make_purejax_3d,
    "purejax": gpt_train.make_purejax,
    "purejax-unrolled": make_purejax_unrolled,
    "raw": gpt_train.make_raw,
    "nnx-split": partial(gpt_train.make_nnx, mode="split"),
}


def section_profile(setup: Setup, repeats) -> dict:
    """Step times, profiled busy time by kind, and data movement in the HLO, for PROFILED. Returns the steps
    and HLO texts for the later sections."""
    built = {name: build_with_hlo(setup.build, make) for name, make in PROFILED.items()}
    losses = {name: float(step()) for name, (step, _) in built.items()}
    # One update since the first (compiling) call: purejax-3d is the same maths (float32 rounding apart); the
    # peers' AdamW differs in where epsilon and clipping sit (bench/gpt_train.py checks them more closely).
    for name, loss in losses.items():
        rtol = 1e-5 if name.startswith("purejax") else 1e-3
        np.testing.assert_allclose(loss, losses["purejax"], rtol=rtol, err_msg=f"{setup.name}: {name}'s loss differs")
    ms = _medians({name: step for name, (step, _) in built.items()}, setup, repeats)
    # Profiles in rounds, every contender once per round, and per kind the median over the rounds: a burst of
    # other jobs then spoils one round's figures, not one contender's.
    rounds = [{name: profile(step, hlo, steps=2) for name, (step, hlo) in built.items()} for _ in range(3)]
    rows = []
    for name, (_step, hlo) in built.items():
        busy = {k: statistics.median(r[name].get(k, 0.0) for r in rounds) for k in (*KINDS, "wall", "thunks")}
        moved = movement(hlo)
        total = sum(busy.get(k, 0.0) for k in KINDS)
        rows.append([name, f"{ms[name]:.1f}", f"{ms[name] / ms['purejax']:.2f}", f"{busy['wall']:.1f}",
                     *(f"{busy.get(k, 0.0):.1f}" for k in KINDS), f"{total:.1f}", f"{busy['thunks']:.0f}",
                     " + ".join(f"{n} {kind}" for kind, (n, _) in sorted(moved.items())) or "0",
                     f"{sum(b for _, b in moved.values()) / 2**20:.1f}"])  # fmt: skip
    print(f"\n### {setup.name}: where the step's time goes (ms per step; busy = summed over XLA's threads)")
    _table(("contender", "step ms", "/ purejax", "profiled ms", *KINDS, "busy total", "kernels run",
            "movement ops in HLO", "their MiB"), rows)  # fmt: skip
    return built


def section_dots(setup: Setup, built: dict, repeats: int) -> None:
    """purejax's matmuls timed one by one in XLA and torch; totals against the profiled step."""
    rows, totals = [], collections.Counter()
    for contender in ("purejax-3d", "purejax"):
        dots = step_dots(built[contender][1], setup.case.model.n_layer)
        times = time_dots(list(dots), repeats)
        for (dot, runs), (xla, torch_s) in zip(dots.items(), times):
            totals[contender, "xla"] += xla * runs * 1e3
            totals[contender, "torch"] += torch_s * runs * 1e3
            totals[contender, "gflop"] += dot.flops * runs / 1e9
            if contender == "purejax":
                rows.append([dot.describe(), dot.kernel, runs, f"{xla * 1e6:.0f}", f"{torch_s * 1e6:.0f}",
                             f"{dot.flops / xla / 1e9:.0f}", f"{dot.flops / torch_s / 1e9:.0f}"])  # fmt: skip
    print(f"\n### {setup.name}: purejax's matmuls alone (dims in memory order, k = contracted, b = batch)")
    _table(("dot", "XLA kernel", "runs / step", "XLA us", "torch us", "XLA GFLOP/s", "torch GFLOP/s"), rows)
    tp = torch_profile(setup)
    print(f"\n### {setup.name}: matmul totals per step (ms)")
    _table(("step", "GFLOP", "XLA dots alone", "same dots in torch", "torch / XLA"),
           [[c, f"{totals[c, 'gflop']:.2f}", f"{totals[c, 'xla']:.1f}", f"{totals[c, 'torch']:.1f}",
             f"{totals[c, 'torch'] / totals[c, 'xla']:.2f}"] for c in ("purejax-3d", "purejax")])  # fmt: skip
    print(
        f"torch eager step under its profiler: {tp['wall']:.1f} ms, of which matmul kernels {tp['matmul']:.1f} ms"
        f" and attention kernels {tp['attention']:.1f} ms"
    )


def section_attention(setup: Setup, repeats) -> None:
    """purejax with the fused attention against the einsum formulation, and the same with 3-D matmuls."""
    steps = {"fused": setup.build(gpt_train.make_purejax, attention_impl="fused"),
             "einsum": setup.build(gpt_train.make_purejax, attention_impl="einsum"),
             "3-D matmuls, fused": setup.build(make_purejax_3d, attention_impl="fused"),
             "3-D matmuls, einsum": setup.build(make_purejax_3d, attention_impl="einsum")}  # fmt: skip
    losses = {name: float(step()) for name, step in steps.items()}
    ms = _medians(steps, setup, repeats)
    print(f"\n### {setup.name}: attention formulation (purejax step)")
    _table(
        ("attention", "step ms", "/ fused", "first loss"),
        [[n, f"{ms[n]:.1f}", f"{ms[n] / ms['fused']:.2f}", f"{losses[n]:.7f}"] for n in steps],
    )


def section_step(setup: Setup, repeats) -> None:
    """fwd, fwd+bwd and the full step for purejax and NNX; purejax's step variants."""
    parts = {}
    for part in ("fwd", "fwd+bwd"):
        parts[f"purejax {part}"] = setup.build(partial(make_purejax_part, part=part))
        parts[f"nnx {part}"] = setup.build(partial(make_nnx_part, part=part))
        parts[f"purejax-3d {part}"] = traced_in(setup.build(partial(make_purejax_part, part=part)), matmuls_3d=True)
    steps = {
        "purejax step": setup.build(gpt_train.make_purejax),
        "nnx step (split)": setup.build(partial(gpt_train.make_nnx, mode="split")),
        "purejax-3d step": setup.build(make_purejax_3d),
        "purejax step, no donation": setup.build(partial(make_purejax_variant, donate=False)),
        "purejax step, fused AdamW": setup.build(partial(make_purejax_variant, optimizer="fused")),
        "purejax step, scan unrolled": setup.build(make_purejax_unrolled),
        "purejax step, loop": setup.build(gpt_train.make_purejax, layers="loop"),
    }
    ms = _medians({**parts, **steps}, setup, repeats)
    print(f"\n### {setup.name}: forward, backward, the step around them (ms)")
    rows = []
    for name, v in ms.items():
        base = "purejax " + name.rsplit(" ", 1)[1] if name.endswith(("fwd", "bwd")) else "purejax step"
        rows.append([name, f"{v:.1f}", f"{v / ms[base]:.2f}"])
    _table(("what", "ms", "/ purejax's same part"), rows)


# XLA:CPU flags worth timing (all listed by `xla_cpu_flags()`), with what each changes.
FLAGS = {
    "default": "",
    "fast math": "--xla_cpu_enable_fast_math=true",
    "no YNNPACK (Eigen dots)": "--xla_cpu_experimental_ynn_fusion_type=",
    "YNNPACK without reductions": "--xla_cpu_experimental_ynn_fusion_type=-reduce",
    "oneDNN dot fusions": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_onednn_fusion_type=dot",
    "XNNPACK graph fusion": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "Eigen single-threaded": "--xla_cpu_multi_thread_eigen=false",
    "concurrency scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "tiling propagation": "--xla_cpu_experimental_enable_tiling_propagation=true",
    "old fusion emitters": "--xla_cpu_use_fusion_emitters=false",
    "copy insertion region analysis": "--xla_cpu_copy_insertion_use_region_analysis=true",
}


def xla_cpu_flags() -> list[str]:
    """Every `xla_cpu_*` flag name compiled into this jaxlib (the strings of libjax_common.so)."""
    import jaxlib

    names = set()
    for path in glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "*.so")):
        with open(path, "rb") as f:
            names |= {m.decode() for m in re.findall(rb"\x00(xla_cpu_[a-z0-9_]+)\x00", f.read())}
    return sorted(names)


def worker(name: str, repeats: int) -> None:
    """Run in a subprocess by section_flags, under its XLA_FLAGS: purejax and purejax-3d at config `name`,
    timed interleaved; prints one JSON line (ms, the first two losses, the kinds of library fusions)."""
    setup = Setup.make(name)
    step, hlo = build_with_hlo(setup.build, gpt_train.make_purejax)
    old, _ = build_with_hlo(setup.build, make_purejax_3d)
    losses = [float(step()) for _ in range(1)]  # the compiling call was the first; this is after one update
    ms = _medians({"purejax": step, "purejax-3d": old}, setup, repeats)
    kinds = collections.Counter(re.findall(r'"kind":"(__\w+_fusion)"', hlo))
    print(json.dumps({"ms": ms, "losses": losses, "fusions": kinds, "dots": len(re.findall(r" dot\(", hlo))}))


def section_flags(configs, repeats) -> None:
    """Each of FLAGS in a fresh process (XLA_FLAGS is read once); default first and again last."""
    print(f"\nxla_cpu flags in this jaxlib: {', '.join(xla_cpu_flags())}")
    for name in configs:
        runs = {}
        for label, flags in [*FLAGS.items(), ("default, again", "")]:
            env = {**os.environ, "XLA_FLAGS": f"{flags} {DUMP_FLAGS}"}
            cmd = [sys.executable, "-m", "bench.gpt_anatomy", "--worker", name, "--repeats", str(repeats or 5)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                runs[label] = proc.stderr.strip().splitlines()[-1][:100]
            else:
                runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {name} {label}: {runs[label]}", flush=True)
        base = statistics.mean(runs[k]["ms"]["purejax"] for k in ("default", "default, again"))
        ref = runs["default"]["losses"][0]
        rows = []
        for label, run in runs.items():
            if isinstance(run, str):
                rows.append([label, FLAGS.get(label, "") or "(none)", "failed: " + run, "", "", "", ""])
                continue
            pj, old = run["ms"]["purejax"], run["ms"]["purejax-3d"]
            fusions = ", ".join(f"{n} {k.strip('_')}" for k, n in run["fusions"].items()) or "none"
            flags = f"`{FLAGS[label]}`" if FLAGS.get(label) else "(none)"
            rows.append([label, flags, f"{pj:.1f}", f"{pj / base:.2f}", f"{old:.1f}", f"{old / pj:.2f}",
                         f"{run['losses'][0] - ref:+.1e}", f"{fusions}; {run['dots']} dots"])  # fmt: skip
        print(f"\n### {name}: XLA flags (each in its own process; / default: against the mean of both default runs)")
        _table(("setting", "XLA_FLAGS", "purejax ms", "/ default", "purejax-3d ms", "3d / purejax",
                "loss - default's", "library fusions in the step"), rows)  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="baby,small", help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved samples (default: gpt_train's + 2)")
    parser.add_argument("--flag-configs", default="baby", help="configs the flags section times (default: baby)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.repeats)
    configs, sections = args.configs.split(","), args.sections.split(",")
    for kind, given, valid in (("config", configs, CONFIGS), ("section", sections, SECTIONS)):
        unknown = [g for g in given if g not in valid]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")
    if jax.config.jax_platforms not in (None, "", "cpu"):
        parser.error("this investigation is about XLA:CPU; run with JAX_PLATFORMS=cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DUMP_FLAGS}"  # before the backend starts
    start = time.perf_counter()
    print(f"{gpt_train.versions()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    for name in configs:
        setup = Setup.make(name)
        built = section_profile(setup, args.repeats) if {"profile", "dots"} & set(sections) else None
        if "dots" in sections:
            section_dots(setup, built, args.repeats or 5)
        if "attention" in sections:
            section_attention(setup, args.repeats)
        if "step" in sections:
            section_step(setup, args.repeats)
    if "flags" in sections:
        section_flags(args.flag_configs.split(","), args.repeats)
    print(f"\ntotal {time.perf_counter() - start:.0f}s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
