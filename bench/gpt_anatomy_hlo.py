"""The optimized HLO of a GPT training step, read for bench/gpt_anatomy.py: XLA dumps it when the step compiles
(`DUMP_FLAGS`, `build_with_hlo`), `parse_hlo` reads its instructions, `kind_of` says what kind of kernel each
runs (matmul, layout change, elementwise fusion, ...), `movement` counts the data it moves into new layouts,
and `step_dots` lists the step's matmuls with the physical layouts of their operands.

Nothing here times or profiles a step (bench/gpt_anatomy_profile.py does).
"""

import collections
import dataclasses
import glob
import os
import re
import tempfile
import time

import jax
import numpy as np

# XLA writes the optimized HLO of every module whose name matches to this folder, when XLA_FLAGS asks before the
# backend starts (bench/gpt_anatomy.py's main does). The contenders of bench/gpt_train.py jit functions named *step*.
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


# The kinds of kernel `kind_of` tells apart, in the order the tables show them.
KINDS = ("matmul (YNNPACK)", "matmul (Eigen)", "layout change", "elementwise fusion", "reduction (YNNPACK)", "other")


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
        dot = Dot(
            lhs,
            rhs,
            (
                tuple(lpos[d] for d in _dims(instr.line, "lhs_contracting_dims")),
                tuple(rpos[d] for d in _dims(instr.line, "rhs_contracting_dims")),
            ),
            (
                tuple(lpos[d] for d in _dims(instr.line, "lhs_batch_dims")),
                tuple(rpos[d] for d in _dims(instr.line, "rhs_batch_dims")),
            ),
            "YNNPACK" if instr.computation in ynn else "Eigen",
        )
        out[dot] += n_layer if "while/body" in instr.line else 1
    return out
