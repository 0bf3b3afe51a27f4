"""`python -m train.gpt --pp` and `--cp` compute what one device computes, and their checkpoints move
between meshes.

One single-device run of 12 iterations is the reference. A dp=2 x pp=2 run (1F1B) trains iterations 0..8; its
checkpoint resumes on one device and, separately, on --dp=2, for 4 more. A --cp=2 run's checkpoint resumes on
one device. Two processes of one device each run --pp=2 and --cp=2 (jax.distributed over gloo, started by
purejax.parallel.launch as tests/train/test_parallel.py does). All are compared with the reference:
params and AdamW moments to float32 rounding (the sharded sums add in another order), and the evaluated val
loss, which with --pp comes from the pipelined forward pass on the stage-sharded params.

With dropout a pipeline of M micro-batches gives micro-batch m the key `split(key, M)[m]`, as one device's
gradient accumulation over M micro-batches does; tests/purejax/parallel/test_pipeline.py checks that inside
the training step (pp=2 x dp=2 with dropout against one device), so no program run here repeats it.
"""

import json
import shutil

import jax
import numpy as np
import pytest

from tests.train.test_gpt import TINY, corpus, final_state, finish, run_gpt  # noqa: F401 - corpus: a fixture
from tests.train.test_parallel import assert_same_state, launch_gpt
from train.gpt import GPTSettings
from train.kit import settings as settings_lib

PIPELINE_ATOL = 2e-5  # a fiftieth of a step: see assert_ring_params_close
COMMON = [
    *TINY,
    "--n_layer=4",
    "--lr_decay_iters=12",
    "--warmup_iters=2",
    "--eval_interval=4",
    "--eval_iters=1",
    "--log_interval=4",
    "--batch_size=8",
]


def assert_ring_params_close(got, want, what: str) -> None:
    """The params of a --cp run against one device's. The ring's online softmax rounds differently from dense
    attention, and Adam scales the rounding of a near-zero gradient up to a step's size (1e-3 here): one
    weight of mlp.proj.w's 16384 was 7.5e-6 off after 8 steps (measured), beyond assert_same_state's 2e-6.
    2e-5 is a fiftieth of a step, as for Shampoo in test_parallel.py. The pipeline's micro-batches round
    differently too: under the suite's less optimized XLA (tests/conftest.py) the same weight was 8e-6 (dp x pp)
    and 1.1e-5 (two processes) off, so the pipelined runs' states are compared within PIPELINE_ATOL."""
    assert int(got.step) == int(want.step), what
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def val_losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["iter"]: row["val_loss"] for row in rows if "val_loss" in row}


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):  # noqa: F811 - corpus: the imported fixture
    """The reference: one device, 12 iterations, a checkpoint every 4; returns (its directory, the corpus)."""
    cwd = tmp_path_factory.mktemp("single")
    finish(run_gpt([*COMMON, f"--dataset={corpus}", "--out_dir=run", "--max_iters=12"], cwd))
    return cwd / "run", corpus


def test_dp_x_pp_trains_like_one_device_and_resumes_on_one_device_and_on_dp(tmp_path, single):
    reference, text = single
    common = [*COMMON, f"--dataset={text}"]
    out = finish(run_gpt([*common, "--out_dir=pp", "--max_iters=8", "--dp=2", "--pp=2", "--micro_batches=2"], tmp_path))
    assert "devices: 2 x 1 mesh, 2 pipeline stages (1f1b, 2 micro-batches) of 4 cpu devices" in out, out
    assert_same_state(final_state(tmp_path / "pp", 8), final_state(reference, 8), "dp=2 x pp=2 at 8", PIPELINE_ATOL)
    got, want = val_losses(tmp_path / "pp"), val_losses(reference)
    assert got.keys() == {0, 4, 8} and all(got[i] == pytest.approx(want[i], rel=1e-5) for i in got), (got, want)

    shutil.copytree(tmp_path / "pp", tmp_path / "pp-dp")
    out = finish(run_gpt([*common, "--out_dir=pp", "--max_iters=12", "--init_from=resume"], tmp_path))
    assert "devices:" not in out, "resumed on one device: the devices are this launch's, not the checkpoint's"
    assert_same_state(final_state(tmp_path / "pp", 12), final_state(reference, 12), "pp=2 -> 1 device", PIPELINE_ATOL)
    finish(run_gpt([*common, "--out_dir=pp-dp", "--max_iters=12", "--init_from=resume", "--dp=2"], tmp_path))
    assert_same_state(final_state(tmp_path / "pp-dp", 12), final_state(reference, 12), "pp=2 -> dp=2", PIPELINE_ATOL)


def test_a_cp_checkpoint_resumes_on_one_device(tmp_path, single):
    reference, text = single
    common = [*COMMON, f"--dataset={text}", "--out_dir=cp"]
    out = finish(run_gpt([*common, "--max_iters=8", "--cp=2"], tmp_path))
    assert "sequences split over cp=2" in out, out
    finish(run_gpt([*common, "--max_iters=12", "--init_from=resume"], tmp_path))
    assert_ring_params_close(final_state(tmp_path / "cp", 12), final_state(reference, 12), "cp=2 -> one device")


@pytest.mark.parametrize("flag", ["--pp=2", "--cp=2"])
def test_two_processes_of_one_device_each_train_like_one_device(tmp_path, single, flag):
    """Each process holds one pipeline stage (--pp) or one half of every sequence (--cp): the activations (or
    key/value blocks) cross processes with ppermute, the tied embedding's gradient with an all-reduce."""
    reference, text = single
    args = [*COMMON, f"--dataset={text}", "--out_dir=run", "--max_iters=8", flag]
    results, outputs = launch_gpt(args, tmp_path, devices_per_process=1)
    assert "of 2 cpu devices in 2 process(es)" in results[0].output, outputs
    got, want, what = final_state(tmp_path / "run", 8), final_state(reference, 8), f"{flag}, 2 processes at 8"
    if flag == "--cp=2":
        assert_ring_params_close(got, want, what)
    else:
        assert_same_state(got, want, what, PIPELINE_ATOL)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(pp=2, dp=2, fsdp=True), "--pp=2 (pipeline parallelism) does not combine with --fsdp"),
        (dict(pp=2, cp=2), "does not combine with --cp=2"),
        (dict(pp=2, optimizer="muon"), "does not combine with --optimizer=muon"),
        (dict(pp=3, n_layer=4), "need n_layer=4 to divide by 3"),
        (dict(pp=2, n_layer=4, dp=2, batch_size=8, micro_batches=3), "multiple of dp x micro_batches = 6"),
        (dict(micro_batches=2), "--micro_batches=2 splits each batch between pipeline stages, but --pp=1"),
    ],
)
def test_impossible_pipeline_settings_are_refused_before_anything_runs(settings, message):
    with pytest.raises(settings_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTSettings(**settings)


def test_the_command_line_refuses_them_before_compiling(tmp_path, corpus):  # noqa: F811
    proc = run_gpt([*COMMON, f"--dataset={corpus}", "--pp=2", "--dp=2", "--fsdp=true"], tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "does not combine with --fsdp" in out and "Traceback" not in out, out
