"""bench/parallel.py's sequence-, expert-, context- and pipeline-parallel rows (bench/parallel_cases.py) at a
tiny size: the collectives counted in the compiled HLO equal the theory's formulas (bench/parallel_theory.py;
elements per device, and ops where the theory fixes them), nothing else crosses the devices, and the memory
per device moves the way the bench's tables say. Counts only, no timing.

The bench needs 8 simulated CPU devices (XLA_FLAGS must be set before jax is imported; the test process has
one), so this file runs itself as a child process once per module and the tests judge what it wrote:

    python tests/bench/test_bench_parallel.py OUT.json
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from tests.children import child_results

ROOT = Path(__file__).resolve().parents[2]
# (n_layer, n_head, n_embd, block_size, vocab_size): 4 layers so that 4 stages get one each
TINY = (4, 2, 16, 16, 32)
BATCH = 4
CONTEXT_MESHES = ((2, 4),)  # (dp, cp); bench.parallel's table has cp 2, 4 and 8, the same formula
PIPELINES = ((2, "gpipe"), (2, "1f1b"))  # (stages, schedule); the formula has S in it, tests/purejax/parallel
# test_pipeline.py checks it at 4 stages
MICRO_BATCHES = 4
LONG = (1, 2, 16, 256, 32)  # one layer over a 256-token sequence: the memory is the attention's
# (dp, tp, fsdp, sp, ep): sequence parallelism with data parallelism; experts with tensor parallelism (FSDP x EP's
# all-to-alls are counted in tests/purejax/parallel/test_experts.py)
SEQUENCE_MODES = {"2D+SP": (4, 2, False, True, False)}
EXPERT_MODES = {"2D+EP": (4, 2, False, False, True)}
N_EXPERTS, STEP_BATCH = 8, 8


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return child_results(__file__, tmp_path_factory.mktemp("bench_parallel"))


@pytest.mark.parametrize("mode", [*SEQUENCE_MODES, *EXPERT_MODES])
def test_sequence_and_expert_parallel_steps_move_what_the_theory_says(results, mode):
    """Every kind of collective the step executes moves the theory's elements per device (all-gathers and
    reduce-scatters for SP, all-to-alls for EP, the all-reduces of both), and no other kind runs."""
    row = next(r for r in results["steps"] if r["mode"] == mode)
    got, want = row["got"], row["theory"]
    assert {kind: got.get(kind, [0, 0])[1] for kind in want} == {kind: w[1] for kind, w in want.items()}
    assert set(got) <= set(want)
    assert got[{"2D+SP": "reduce-scatter"}.get(mode, "all-to-all")][1] > 0  # the mode's own collective ran


@pytest.mark.parametrize("mesh", [f"{dp}x{cp}" for dp, cp in CONTEXT_MESHES])
def test_context_parallel_step_moves_what_the_ring_should(results, mesh):
    """2 L (n-1) collective-permutes of one device's k and v block, and the gradients' and the loss's all-reduce
    over data and context (P + 2 elements, in however many ops XLA combines them into); nothing else."""
    row = next(r for r in results["context"] if r["mesh"] == mesh)
    got, want = row["got"], row["theory"]
    assert got["collective-permute"] == want["collective-permute"]
    assert got["all-reduce"][1] == want["all-reduce"][1]
    assert set(got) == {"collective-permute", "all-reduce"}


def test_the_context_formula_worked_by_hand(results):
    """dp = 2, cp = 4: 4 layers x 2 x (4 - 1) = 24 permutes, each k and v of 2 rows x 4 tokens x 16 = 256
    elements; the all-reduce: every param (4 blocks of 12 d^2 + 13 d, wte 32 d, wpe 16 d, ln_f 2 d; d = 16) + 2."""
    row = next(r for r in results["context"] if r["mesh"] == "2x4")
    d = 16
    assert row["theory"]["collective-permute"] == [24, 24 * 256]
    assert row["theory"]["all-reduce"][1] == 4 * (12 * d * d + 13 * d) + 32 * d + 16 * d + 2 * d + 2


@pytest.mark.parametrize("case", [f"PP {s} {name}" for s, name in PIPELINES])
def test_pipeline_moves_two_activations_per_step_and_one_all_reduce(results, case):
    """2 T collective-permutes of one micro-batch's activations, T = 2 (M + S - 1), then one all-reduce of the
    shared params' gradients and the loss; nothing else."""
    row = next(r for r in results["pipeline"] if r["mode"] == case)
    n_stages = int(case.split()[1])
    steps = 2 * (MICRO_BATCHES + n_stages - 1)
    assert row["theory"]["collective-permute"] == [2 * steps, 2 * steps * (BATCH // MICRO_BATCHES) * 16 * 16]
    assert row["got"] == row["theory"]


def test_1f1b_needs_fewer_temporaries_than_gpipe(results):
    """S = 2, M = 4: 1F1B's buffers hold 2 micro-batches, GPipe's 4; XLA's temporaries differ by at most that."""
    gpipe, one_f_one_b = (next(r for r in results["pipeline"] if r["mode"] == f"PP 2 {n}") for n in ("gpipe", "1f1b"))
    assert 0 < gpipe["temp_bytes"] - one_f_one_b["temp_bytes"] <= gpipe["buffer_bytes"] - one_f_one_b["buffer_bytes"]
    assert gpipe["buffer_bytes"] == 2 * 4 * (BATCH // MICRO_BATCHES) * 16 * 16 * 4


def test_context_parallel_memory_per_device_falls_with_the_ring(results):
    """A 256-token sequence: one device's temporaries on a 4-device ring are under half of one device's."""
    memory = results["memory"]
    assert memory["4"] < memory["1"] / 2


def main(out: str) -> None:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    from jaxtyping import install_import_hook

    # run-time shape checks, as in the test process (tests/conftest.py)
    install_import_hook(["purejax"], "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")
    from bench import parallel_cases as bench
    from models import gpt, gpt_moe

    def config(n_layer, n_head, n_embd, block_size, vocab_size):
        return gpt.GPTConfig(
            block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
        )

    moe = gpt_moe.MoEConfig(**dataclasses.asdict(config(*TINY)), n_experts=N_EXPERTS)
    results = {
        "steps": bench.step_rows(config(*TINY), STEP_BATCH, SEQUENCE_MODES)
        + bench.step_rows(moe, STEP_BATCH, EXPERT_MODES),
        "context": bench.context_rows(config(*TINY), BATCH, CONTEXT_MESHES),
        "pipeline": bench.pipeline_rows(config(*TINY), BATCH, MICRO_BATCHES, PIPELINES),
        "memory": bench.context_memory(config(*LONG), 1, (1, 4)),
    }
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
