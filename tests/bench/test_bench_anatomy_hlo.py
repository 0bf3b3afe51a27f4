"""bench/gpt_anatomy_hlo.py: how the optimized HLO of a training step is read. On a small hand-written module
(tests/bench/data/anatomy_step.hlo.txt: YNNPACK fusions with and without a dot, Eigen dots plain, fused and in
a while body, standalone copies and transposes, a loop fusion writing a transpose), every figure worked out by
hand: the instructions `parse_hlo` finds, the kind `kind_of` gives each, what `movement` counts, the dots
`step_dots` lists with their physical layouts and flops. Then one module XLA really dumped, compiled in a child
process (XLA_FLAGS is read once, when the backend starts)."""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bench.gpt_anatomy_hlo import (
    DUMP_FLAGS,
    KINDS,
    Dot,
    _nbytes,
    _physical,
    kind_of,
    movement,
    parse_hlo,
    step_dots,
)

ROOT = Path(__file__).resolve().parents[2]
HLO = (Path(__file__).parent / "data" / "anatomy_step.hlo.txt").read_text()

# Every instruction of the module, computation by computation: name, opcode, result shape as printed.
INSTRUCTIONS = {
    "fused_ynn_dot": [
        ("param_0", "parameter", "f32[8,16]{1,0}"),
        ("param_1", "parameter", "f32[16,4]{0,1}"),
        ("dot.1", "dot", "f32[8,4]{1,0}"),
    ],
    "add_region": [("a.1", "parameter", "f32[]"), ("b.1", "parameter", "f32[]"), ("add.1", "add", "f32[]")],
    "fused_ynn_reduce": [
        ("param_0.1", "parameter", "f32[8,16]{1,0}"),
        ("constant.1", "constant", "f32[]"),
        ("reduce.1", "reduce", "f32[8]{0}"),
    ],
    "fused_eigen_dot": [
        ("param_0.2", "parameter", "f32[8,4]{1,0}"),
        ("param_1.2", "parameter", "f32[4,2]{1,0}"),
        ("dot.2", "dot", "f32[8,2]{1,0}"),
        ("tanh.2", "tanh", "f32[8,2]{1,0}"),
    ],
    "fused_transpose": [
        ("param_0.3", "parameter", "f32[8,4]{1,0}"),
        ("constant.3", "constant", "f32[]"),
        ("broadcast.3", "broadcast", "f32[8,4]{1,0}"),
        ("multiply.3", "multiply", "f32[8,4]{1,0}"),
        ("transpose.3", "transpose", "f32[4,8]{1,0}"),
    ],
    "fused_elementwise": [
        ("param_0.4", "parameter", "f32[8,2]{1,0}"),
        ("exponential.4", "exponential", "f32[8,2]{1,0}"),
    ],
    "body": [
        ("arg_tuple.5", "parameter", "(s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{1,2,0})"),
        ("get-tuple-element.5", "get-tuple-element", "s32[]"),
        ("get-tuple-element.6", "get-tuple-element", "bf16[2,8,16]{2,1,0}"),
        ("get-tuple-element.7", "get-tuple-element", "bf16[2,16,4]{1,2,0}"),
        ("copy.5", "copy", "s32[]"),
        ("dot.5", "dot", "bf16[2,8,4]{2,1,0}"),
        ("tuple.5", "tuple", "(s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{1,2,0})"),
    ],
    "cond": [
        ("arg_tuple.6", "parameter", "(s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{1,2,0})"),
        ("get-tuple-element.8", "get-tuple-element", "s32[]"),
        ("constant.6", "constant", "s32[]"),
        ("compare.6", "compare", "pred[]"),
    ],
    "main.7": [
        ("x.1", "parameter", "f32[8,16]{1,0}"),
        ("w.1", "parameter", "f32[16,4]{0,1}"),
        ("h.1", "parameter", "bf16[2,8,16]{2,1,0}"),
        ("v.1", "parameter", "bf16[2,16,4]{2,1,0}"),
        ("u.1", "parameter", "f32[4,2]{1,0}"),
        ("copy.7", "copy", "bf16[2,16,4]{1,2,0}"),
        ("transpose.7", "transpose", "f32[16,8]{1,0}"),
        ("ynn_fusion", "fusion", "f32[8,4]{1,0}"),
        ("ynn_fusion.1", "fusion", "f32[8]{0}"),
        ("dot.7", "dot", "f32[8,4]{1,0}"),
        ("dot_tanh_fusion", "fusion", "f32[8,2]{1,0}"),
        ("multiply_transpose_fusion", "fusion", "f32[4,8]{1,0}"),
        ("exponential_fusion", "fusion", "f32[8,2]{1,0}"),
        ("constant.7", "constant", "s32[]"),
        ("tuple.7", "tuple", "(s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{1,2,0})"),
        ("while.7", "while", "(s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{1,2,0})"),
        ("get-tuple-element.9", "get-tuple-element", "s32[]"),
        ("get-tuple-element.10", "get-tuple-element", "bf16[2,16,4]{1,2,0}"),
        (
            "tuple.8",
            "tuple",
            "(f32[8]{0}, f32[16,8]{1,0}, f32[4,8]{1,0}, f32[8,2]{1,0}, s32[], /*index=5*/bf16[2,16,4]{1,2,0})",
        ),
    ],
}


def test_parse_hlo_reads_every_instruction_with_its_opcode_shape_and_computation():
    """Every `%name = shape opcode(...)` line, ROOT or not, tuple shapes included, in the computation whose header
    precedes it; the module header and the FileNames/FileLocations tables are not instructions."""
    hlo = parse_hlo(HLO)
    got = {name: (i.opcode, i.shape, i.computation) for name, i in hlo.items()}
    want = {n: (op, shape, comp) for comp, rows in INSTRUCTIONS.items() for n, op, shape in rows}
    assert got == want
    assert len(hlo) == 50 == sum(" = " in line for line in HLO.splitlines())
    assert all(i.name == name for name, i in hlo.items())
    assert hlo["ynn_fusion"].line.startswith("  %ynn_fusion = ") and '"__ynn_fusion"' in hlo["ynn_fusion"].line


def test_kind_of_sorts_thunks_into_the_kinds_and_none_for_control_flow():
    hlo = parse_hlo(HLO)
    kinds = {
        "ynn_fusion": "matmul (YNNPACK)",  # a __ynn_fusion around a dot
        "ynn_fusion.1": "reduction (YNNPACK)",  # a __ynn_fusion without one
        "dot.7": "matmul (Eigen)",
        "dot.5": "matmul (Eigen)",  # in the while body
        "dot_tanh_fusion": "matmul (Eigen)",  # an XLA fusion around a dot
        "copy.7": "layout change",
        "copy.5": "layout change",
        "transpose.7": "layout change",
        "multiply_transpose_fusion": "layout change",  # its result is written transposed
        "exponential_fusion": "elementwise fusion",
        "constant.7": "other",
        "compare.6": "other",
        "add.1": "other",
    }
    for name, kind in kinds.items():
        assert kind_of(name, hlo) == kind, name
    for name in ("while.7", "x.1", "arg_tuple.5", "tuple.8", "get-tuple-element.9", "ThunkExecutor::Execute"):
        assert kind_of(name, hlo) is None, name
    # bench/gpt_anatomy.py's table has a column per KINDS entry: a kind outside it would be dropped silently.
    # This module has one of each.
    assert {kind_of(name, hlo) for name in hlo} == {*KINDS, None}


def test_movement_counts_standalone_copies_transposes_and_transposing_fusions():
    """copy.7 (bf16[2,16,4]: 256 bytes) and the while body's copy.5 (s32[]: 4, once, not per iteration);
    transpose.7 (f32[16,8]: 512); multiply_transpose_fusion (f32[4,8]: 128). transpose.3 runs inside that fusion
    and is not counted again."""
    moved = movement(HLO)
    assert moved == {"copy": (2, 256 + 4), "transpose": (1, 512), "fusion writing a transpose/copy": (1, 128)}
    # What bench/gpt_anatomy.py's profile table adds up: the ops and the MiB they write.
    assert sum(n for n, _ in moved.values()) == 4 and sum(b for _, b in moved.values()) == 900
    assert movement("HloModule empty\n") == {}


@pytest.mark.parametrize(
    "shape, nbytes",
    [
        ("f32[12,64,512]{2,1,0}", 12 * 64 * 512 * 4),
        ("bf16[3,5]{1,0}", 3 * 5 * 2),
        ("pred[7]{0}", 7),  # a byte per element
        ("s32[2,3]{0,1}", 2 * 3 * 4),
        ("u8[10]{0}", 10),
        ("f32[]", 4),  # a scalar is one element
        ("(f32[4]{0}, s32[])", 0),  # a tuple holds pointers, not data
        ("token[]", 0),
    ],
)
def test_nbytes_of_a_shape(shape, nbytes):
    assert _nbytes(shape) == nbytes


def test_physical_puts_dims_in_memory_order():
    """A layout is minor-to-major: {0,1} stores f32[3,5] as 5 rows of 3, its logical dim 0 innermost. No layout
    means the default, row-major."""
    assert _physical("f32[3,5]{0,1}") == ((5, 3), [1, 0])
    assert _physical("f32[3,5]{1,0}") == ((3, 5), [0, 1])
    assert _physical("f32[3,5]") == ((3, 5), [0, 1])
    assert _physical("bf16[2,16,4]{1,2,0}") == ((2, 4, 16), [0, 2, 1])
    assert _physical("f32[]") == ((), [])


# The module's dots in physical terms. ynn_fusion's and dot.7 multiply x (f32[8,16], row-major) by w
# (f32[16,4]{0,1}: stored as 4 rows of 16), contracting x's dim 1 (position 1) with w's dim 0 (position 1).
# dot.5 (while body) is batched: bf16[2,8,16] by bf16[2,16,4]{1,2,0} (stored (2,4,16)), batch dims 0,
# contracting 2 with 1 (position 2).
YNN_DOT = Dot((8, 16), (4, 16), ((1,), (1,)), ((), ()), "YNNPACK")
EIGEN_DOT = Dot((8, 16), (4, 16), ((1,), (1,)), ((), ()), "Eigen")
FUSED_DOT = Dot((8, 4), (4, 2), ((1,), (0,)), ((), ()), "Eigen")
BODY_DOT = Dot((2, 8, 16), (2, 4, 16), ((2,), (2,)), ((0,), (0,)), "Eigen")


def test_step_dots_lists_each_dot_in_physical_layout_and_how_often_a_step_runs_it():
    assert step_dots(HLO, n_layer=3) == collections.Counter({YNN_DOT: 1, EIGEN_DOT: 1, FUSED_DOT: 1, BODY_DOT: 3})
    assert step_dots(HLO, n_layer=5)[BODY_DOT] == 5
    # 2*M*N*K (times the batch), by hand: M=8, N=4, K=16; M=8, N=2, K=4; batch 2, M=8, N=4, K=16.
    assert YNN_DOT.flops == EIGEN_DOT.flops == 2 * 8 * 4 * 16 == 1024
    assert FUSED_DOT.flops == 2 * 8 * 2 * 4
    assert BODY_DOT.flops == 2 * 2 * 8 * 4 * 16 == 2048
    assert YNN_DOT.describe() == "[8,k16] x [4,k16]"
    assert BODY_DOT.describe() == "[b2,8,k16] x [b2,4,k16]"


@pytest.mark.parametrize("dot", [YNN_DOT, FUSED_DOT, BODY_DOT], ids=["ynn", "fused", "body"])
def test_a_dot_is_a_dot_general_of_arrays_stored_as_the_step_stores_them(dot):
    """bench/gpt_anatomy_profile.py's time_dots runs `lax.dot_general(lhs, rhs, (contract, batch))` on arrays of
    the physical shapes: the dims must line up, and 2 * (its result's size) * (the contracted size) is `flops`."""
    out = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, (dot.contract, dot.batch)),
        jax.ShapeDtypeStruct(dot.lhs, np.float32),
        jax.ShapeDtypeStruct(dot.rhs, np.float32),
    )
    contracted = np.prod([dot.lhs[d] for d in dot.contract[0]])
    assert dot.flops == 2 * np.prod(out.shape) * contracted


CHILD = """
import sys
import jax
import jax.numpy as jnp
from bench.gpt_anatomy_hlo import build_with_hlo

def make():
    @jax.jit
    def train_step(x, w):
        return x @ w.T, x.T * 2
    x, w = jnp.ones((8, 16)), jnp.ones((4, 16))
    return lambda: train_step(x, w)

_, hlo = build_with_hlo(make)
sys.stdout.write(hlo)
"""


def test_a_module_xla_dumped_parses_whole_and_has_its_one_dot(tmp_path):
    """`x @ w.T` (f32[8,16] by f32[4,16]) and `x.T * 2`, jitted with DUMP_FLAGS' dump pointed at tmp_path, in a
    child process. The persistent compilation cache is off there: a program read from it is not compiled, so
    nothing would be dumped."""
    flags = re.sub(r"--xla_dump_to=\S+", f"--xla_dump_to={tmp_path}", DUMP_FLAGS)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stdout
    hlo = parse_hlo(text)
    entry = text[text.index("\nENTRY ") :].split("\n}")[0]
    (entry_name,) = re.findall(r"^ENTRY %([\w.-]+) ", entry, re.M)
    entry_lines = [line for line in entry.splitlines() if " = " in line]
    assert len(entry_lines) >= 3  # x, w and at least the dot's kernel
    assert sorted(i.line for i in hlo.values() if i.computation == entry_name) == sorted(entry_lines)
    assert len(hlo) == sum(" = " in line for line in text.splitlines() if line.startswith("  "))
    ((dot, runs),) = step_dots(text, n_layer=12).items()
    assert runs == 1 and dot.flops == 2 * 8 * 4 * 16
    assert sorted(dot.lhs + dot.rhs) == sorted((8, 16, 4, 16)) and len(dot.contract[0]) == 1
    assert all(kind_of(name, hlo) in (*KINDS, None) for name in hlo)
    # x.T is written out in a new layout (f32[16,8], 512 bytes) at least once.
    assert sum(b for _, b in movement(text).values()) >= 16 * 8 * 4, json.dumps(movement(text))
