"""Pipeline parallelism (purejax/parallel/pipeline_schedules.py, pipeline.py). The schedule tables: every op once and
after its inputs, the bubble fraction against GPipe's formula, 1F1B's bounded activations. On 8 simulated
devices (pipeline_child.py computes, these tests judge): the runner with a stage that is not a GPT (linear
layers, a squared error) equals one device's loss and gradients; the pipelined GPT (models/gpt_pipeline.py):
loss and gradients equal one device's,
with dropout, and the collectives of the compiled program equal the count the schedule implies; inside
`sharded_train_step` on pp, dp x pp and dp x pp x tp meshes, a few AdamW steps equal one device's."""

from pathlib import Path

import pytest

from purejax.parallel import pipeline_schedules
from tests.children import child_results

HERE = Path(__file__).resolve().parent
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 1), (4, 2), (4, 4), (4, 8), (8, 3)]
CASES = ["S4-M4-gpipe-p0.1", "S2-M4-1f1b-p0.1"]
STEP_CASES = [  # pipeline_child.STEP_CASES: pp, dp, tp, schedule, micro-batches, dropout, gradient accumulation
    "pp4-dp1-tp1-1f1b-M4-p0.0-ga2",
    "pp2-dp2-tp1-1f1b-M2-p0.1-ga2",
    "pp2-dp2-tp2-gpipe-M2-p0.0-ga1",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return child_results(HERE / "pipeline_child.py", tmp_path_factory.mktemp("pipeline"))


@pytest.mark.parametrize("name", sorted(pipeline_schedules.SCHEDULES))
@pytest.mark.parametrize("n_stages, n_micro", SHAPES)
def test_schedules_are_valid_and_their_bubble_is_gpipes_formula(name, n_stages, n_micro):
    table = pipeline_schedules.SCHEDULES[name](n_stages, n_micro)
    pipeline_schedules.check(table, n_stages, n_micro)
    assert len(table) == 2 * (n_micro + n_stages - 1)
    assert pipeline_schedules.bubble_fraction(table) == pytest.approx(
        (n_stages - 1) / (n_micro + n_stages - 1), abs=1e-12
    )


@pytest.mark.parametrize("n_stages, n_micro", SHAPES)
def test_1f1b_keeps_at_most_S_activations_per_stage_and_gpipe_keeps_M(n_stages, n_micro):
    one_f_one_b = pipeline_schedules.one_f_one_b(n_stages, n_micro)
    assert max(pipeline_schedules.stored_activations(one_f_one_b)) <= n_stages
    assert pipeline_schedules.buffer_slots(one_f_one_b) <= min(n_stages, n_micro)
    assert pipeline_schedules.stored_activations(pipeline_schedules.gpipe(n_stages, n_micro)) == [n_micro] * n_stages
    assert pipeline_schedules.buffer_slots(pipeline_schedules.gpipe(n_stages, n_micro)) == n_micro


def test_the_tables_read_as_the_papers_draw_them():
    assert (
        pipeline_schedules.render(pipeline_schedules.gpipe(2, 2))
        == "stage 0: F0 F1 .  .  B0 B1\nstage 1: .  F0 F1 B0 B1 ."
    )
    assert (
        pipeline_schedules.render(pipeline_schedules.one_f_one_b(2, 3)).splitlines()[1]
        == "stage 1: .  F0 B0 F1 B1 F2 B2 ."
    )


def test_check_names_the_op_that_runs_too_early_or_is_missing():
    good = pipeline_schedules.gpipe(2, 2)
    early = ((("F", 0), ("F", 0)), (("F", 1), None), *good[2:])  # stage 1's F0 in the step stage 0 runs it
    with pytest.raises(ValueError, match=r"F\(0\) on stage 1 at step 0 runs before \[\('F', 0, 0\)\]"):
        pipeline_schedules.check(early, 2, 2)
    with pytest.raises(ValueError, match="missing"):
        pipeline_schedules.check(pipeline_schedules.gpipe(2, 2)[:-1], 2, 2)
    with pytest.raises(ValueError, match="n_micro must be a positive int"):
        pipeline_schedules.gpipe(2, 0)


@pytest.mark.parametrize("case", CASES)
def test_pipelined_loss_and_gradients_equal_one_device(results, case):
    got = results[case]
    assert got["loss_rel_err"] < 1e-6
    worst = max(got["grad_rel_err"], key=got["grad_rel_err"].get)
    assert got["grad_rel_err"][worst] < 1e-5, (worst, got["grad_rel_err"][worst])
    if case.endswith("p0.1"):  # dropout is on: the loss is not the deterministic one
        assert abs(got["loss"] - got["loss_without_dropout"]) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_collectives_are_two_permutes_per_step_and_one_all_reduce(results, case):
    """Per step of the table, one activation sent forward and one gradient sent back, each one micro-batch of
    (rows, seq 8, n_embd 16); at the end, one all-reduce of wte, wpe, ln_f's gradients and the loss."""
    got = results[case]
    n_stages, n_micro = int(case.split("-")[0][1:]), int(case.split("-")[1][1:])
    steps = 2 * (n_micro + n_stages - 1)
    assert got["steps"] == steps
    assert got["collectives"]["collective-permute"] == {"ops": 2 * steps, "elements": 2 * steps * (4 // n_micro) * 128}
    assert got["collectives"]["all-reduce"] == {"ops": 1, "elements": got["non_block_params"] + 1}
    assert set(got["collectives"]) == {"collective-permute", "all-reduce"}


def test_three_adamw_steps_from_pipelined_gradients_equal_one_device(results):
    """1F1B over 2 stages with 4 micro-batches and dropout, a new key each step: the params after three steps
    (all but the key bias, whose gradient is 0 in exact arithmetic: pipeline_child.adamw_steps)."""
    assert results["S2-M4-1f1b-p0.1"]["adamw_params_rel_err"] < 2e-6


def test_1f1b_compiles_to_fewer_temporaries_than_gpipe(results):
    """S = 2, M = 4: 1F1B's buffers hold 2 micro-batches, GPipe's 4 (XLA's memory analysis of the compiled
    programs; the buffers are 2 x 2 x 512 bytes apart, part of which XLA's buffer sharing absorbs)."""
    assert results["S2-M4-1f1b-p0.1"]["temp_bytes"] < results["gpipe_temp_bytes"]["S2-M4-p0.1"]


def test_the_runner_takes_any_stage_and_equals_one_device(results):
    """A stack of 8 tanh linear layers over 4 stages, 1F1B, 2 micro-batches, a squared error with ignored
    targets: the loss and every gradient equal `jax.value_and_grad` of the same function on one device."""
    got = results["linear"]
    assert got["loss_rel_err"] < 1e-6
    assert set(got["grad_rel_err"]) == {"lift", "blocks.w", "blocks.b", "readout"}
    assert max(got["grad_rel_err"].values()) < 1e-5, got["grad_rel_err"]


def test_a_stack_the_stages_do_not_divide_is_refused_when_called(results):
    assert results["linear"]["depth_error"] == (
        "pipeline: params['blocks'] has 7 layers for 4 stages ('pipe'); the depth must be a multiple of the stage count"
    )


def test_a_table_for_another_stage_count_is_refused():
    import jax

    from purejax.parallel import pipeline

    mesh = jax.make_mesh((1,), (pipeline.PIPE,), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"a table of 2 stages for 1 stages \('pipe'\)"):
        pipeline.sharded_loss_and_grads(mesh, lambda *a, **k: None, pipeline_schedules.gpipe(2, 1), width=16)


@pytest.mark.parametrize("case", STEP_CASES)
def test_training_steps_with_the_pipelined_loss_equal_one_device(results, case):
    """`gpt_pipeline.loss` (a custom_vjp whose gradient the schedule computed) inside `sharded_train_step`:
    three AdamW steps with clipping equal `optim.train_step` on one device, and the forwards alone
    (evaluation) equal `gpt.loss`. The params moved by ~7%, so 1e-6 is float32 rounding, not no change; the
    params after three steps within 1e-5 (5.7e-6 measured under the suite's less optimized XLA, tests/conftest.py)."""
    got = results[case]
    assert got["moved"] > 1e-2
    assert got["loss_rel_err"] < 1e-6 and got["eval_rel_err"] < 1e-6
    assert got["params_rel_err"] < 1e-5


def test_the_pipe_axis_is_the_outermost_and_errors_name_its_size():
    from purejax import parallel

    with pytest.raises(ValueError, match=r"pp=2 x dp=1 x tp=1 = 2 devices, but 1 are given"):
        parallel.make_mesh(1, 1, pp=2)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        parallel.make_mesh(1, 1, pp=0)
    mesh = parallel.make_mesh(1, 1, pp=1)
    assert mesh.axis_names == ("data", "model") and parallel.MeshAxes.of(mesh).pipe is None


def test_stage_specs_split_the_layer_axis_over_pipe_and_keep_the_tensor_parallel_split():
    from jax.sharding import PartitionSpec as P

    from models import gpt, gpt_parallel
    from purejax.parallel import MeshAxes, pipeline

    config = gpt.GPTConfig(block_size=8, vocab_size=32, n_layer=4, n_head=2, n_embd=16)
    specs = pipeline.stage_specs(gpt_parallel.param_specs(config, MeshAxes(model="model"), {"model": 2}))
    assert specs["blocks"]["attn"]["qkv"]["w"] == P("pipe", None, "model")
    assert specs["blocks"]["ln_1"]["scale"] == P("pipe") and specs["wte"]["w"] == P("model", None)
    with pytest.raises(ValueError, match="layer axis is already split"):
        pipeline.stage_specs({"blocks": {"w": P("data")}})


@pytest.mark.parametrize("axes", [dict(data="data", fsdp=True), dict(context="context"), dict()])
def test_the_pipelined_loss_refuses_axes_it_cannot_run_under(axes):
    import jax.numpy as jnp

    from purejax.parallel import MeshAxes, pipeline

    batch = (jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32))
    axes = MeshAxes(**axes, pipe="pipe" if axes else None)
    with pytest.raises(ValueError, match="needs axes.pipe, and no fsdp, context or sequence parallelism"):
        pipeline.loss({}, batch, lambda *a, **k: None, pipeline_schedules.gpipe(2, 2), width=16, axes=axes)
