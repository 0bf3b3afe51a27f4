"""What a run compiles, counted (never timed): each program in a fresh process, as a user starts it, with
`--log_compiles` listing every program. The default GPT run compiles its state, its step and its evaluation
and nothing op by op; classify and flow likewise, and no program compiles again in a later epoch (no
program per epoch, none for a last, shorter evaluation batch)."""

import os
import re
from pathlib import Path

import pytest

from tests.train.fresh_process import run_program

LIMITS = {"train.gpt": 8, "train.classify": 10, "train.flow": 10}  # issue 30's targets
SMALL_GPT = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=1"]
SMALL_CLASSIFY = ["--version=v1", "--width=0.25", "--num_downsamples=2", "--batch_size=256", "--augment=false"]


def compiled_programs(program: str, args: list[str], cwd: Path) -> list[str]:
    """The names of the programs `python -m <program> <args> --log_compiles` compiled, in order, read from the
    lines after its "compiled N programs" summary (the count checked against the list)."""
    stdout = run_program(program, [*args, "--progress=false", "--log_compiles", "--compile_cache=off"], cwd)
    summary = re.search(r"^compiled (\d+) programs in .*\n((?:  .*\n?)*)", stdout, re.MULTILINE)
    assert summary, stdout
    names = [line.split()[0] for line in summary.group(2).splitlines()]
    assert len(names) == int(summary.group(1)) <= LIMITS[program], stdout
    return names


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(Path(os.__file__).read_text()[:30_000])  # a Python source as text
    return path


def test_the_default_gpt_run_compiles_its_state_step_and_evaluation_once(tmp_path, corpus):
    args = [f"--dataset={corpus}", *SMALL_GPT, "--max_iters=6", "--eval_interval=3", "--log_interval=2"]
    names = compiled_programs("train.gpt", [*args, f"--out_dir={tmp_path / 'gpt'}"], tmp_path)
    assert names == ["new_state", "eval_loss", "train_step"]  # before the loop, at iteration 0, in the first step
    on_mesh = compiled_programs(
        "train.gpt", [*args, "--dp=2", "--tp=2", "--fsdp", f"--out_dir={tmp_path / 'mesh'}"], tmp_path
    )
    assert on_mesh == ["new_state", "eval_loss", "step"]  # the state built where it lies; the sharded step


@pytest.mark.usefixtures("needs_sklearn")
def test_classify_compiles_each_program_once_over_two_epochs(tmp_path):
    """Two epochs, each ending in an evaluation of 359 images, and every program compiled once: nothing grows
    with the epochs."""
    names = compiled_programs("train.classify", [*SMALL_CLASSIFY, "--epochs=2", f"--out_dir={tmp_path}"], tmp_path)
    assert names == ["new_state", "train_step", "scores"]


@pytest.mark.usefixtures("needs_sklearn")
def test_flow_compiles_its_state_step_sampler_and_judge(tmp_path):
    names = compiled_programs("train.flow", ["--config=flow_tiny", "--max_iters=10", f"--out_dir={tmp_path}"], tmp_path)
    assert sorted(names) == ["new_state", "sample_images", "sample_images", "train_step"]  # sample grid, judged
