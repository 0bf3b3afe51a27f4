"""End to end through the command line: `python -m train.gpt` trains, stops on SIGTERM with a checkpoint,
resumes bit for bit, and rejects impossible configurations before compiling anything."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from purejax import checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config=gpt_tiny", "--progress=false", "--peak_flops=1e11"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~60 KB of text: the standard library's pydoc topics, the start of the default corpus."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(topics[k] for k in sorted(topics))[:60_000])
    return path


def run_gpt(args: list[str], cwd: Path, env_extra: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "train.gpt", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def final_state(out_dir: Path, step: int):
    tree, info = checkpoint.restore(out_dir / f"ckpt_{step:08d}.msgpack")
    assert info.step == step
    return tree


def test_tiny_run_learns(tmp_path, corpus):
    args = [*TINY, f"--dataset={corpus}", "--out_dir=out", "--max_iters=60", "--lr_decay_iters=60"]
    out = finish(run_gpt(args, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert evals[0]["iter"] == 0 and evals[-1]["iter"] == 60
    # uniform over the ~80-character vocabulary is ~4.4; recorded after 60 steps: ~3.2
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.8, out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "loss.png").exists()
    else:  # the newest-JAX environment has no matplotlib: a line says why there is no plot
        assert "loss.png skipped: matplotlib is not installed" in out


def test_sigterm_saves_and_resume_is_bit_exact(tmp_path, corpus):
    common = [
        *TINY,
        f"--dataset={corpus}",
        "--max_iters=30",
        "--lr_decay_iters=30",
        "--eval_interval=1000",
        "--log_interval=2",
        "--dropout=0.1",
    ]
    finish(run_gpt([*common, "--out_dir=straight"], tmp_path))

    proc = run_gpt([*common, "--out_dir=stopped"], tmp_path)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and any('"loss"' in line for line in metrics.read_text().splitlines())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert "saving a checkpoint" in out
    stopped_at = checkpoint.CheckpointManager(tmp_path / "stopped").latest_step()
    assert 0 < stopped_at < 30, out

    out = finish(run_gpt([*common, "--out_dir=stopped", "--init_from=resume"], tmp_path))
    assert f"at iter {stopped_at}" in out
    straight, resumed = final_state(tmp_path / "straight", 30), final_state(tmp_path / "stopped", 30)
    for a, b in zip(_leaves(straight), _leaves(resumed)):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    return [np.asarray(jax.random.key_data(x)) if _is_key(x) else np.asarray(x) for x in leaves]


def _is_key(x):
    import jax

    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n_embd=30", "--n_head=4"], "not divisible by n_head"),
        (["--block_size=100000"], "block_size=100000 needs more than"),
        (["--dataset=does/not/exist.txt"], "does/not/exist.txt"),
        (["--out_dir=/proc/purejax-cannot-write-here"], "is not writable"),
        (["--no_such_key=1"], "valid keys"),
        (["--max_iters=many"], "--max_iters=many: expected int"),
        (["--init_from=resume", "--out_dir=empty"], "has no readable checkpoint"),
    ],
)
def test_impossible_configs_fail_before_compiling(tmp_path, corpus, args, message):
    proc = run_gpt([*TINY, f"--dataset={corpus}", *args], tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert message in out
    assert "compiled" not in out and "Traceback" not in out


@pytest.mark.parametrize("reason, evaluates_again", [("signal", True), ("eval", False)])
def test_resume_evaluates_a_due_iteration_unless_the_checkpoint_was_saved_after_evaluating_it(
    tmp_path, corpus, reason, evaluates_again
):
    """A checkpoint saved on a signal at an iteration where an evaluation is due has not evaluated it yet; one
    saved after an evaluation has. Resuming runs the evaluation only in the first case."""
    finish(run_gpt([*TINY, f"--dataset={corpus}", "--out_dir=run", "--max_iters=4", "--eval_interval=1000"], tmp_path))
    manager = checkpoint.CheckpointManager(tmp_path / "run", keep_last=None)
    tree, info = checkpoint.restore(manager.path(4))
    manager.save(4, tree, config=info.config, metadata={**info.metadata, "reason": reason})  # as if so saved
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text().count("val_loss")
    finish(
        run_gpt(
            [*TINY, f"--dataset={corpus}", "--out_dir=run", "--init_from=resume", "--max_iters=4", "--eval_interval=2"],
            tmp_path,
        )
    )
    evaluations = [row for line in metrics.read_text().splitlines() if "val_loss" in (row := json.loads(line))]
    assert metrics.read_text().count("val_loss") - before == int(evaluates_again)
    assert not evaluates_again or evaluations[-1]["iter"] == 4


def test_resume_with_a_conflicting_override_is_rejected(tmp_path, corpus):
    finish(run_gpt([*TINY, f"--dataset={corpus}", "--out_dir=run", "--max_iters=2", "--eval_interval=1000"], tmp_path))
    proc = run_gpt([*TINY, f"--dataset={corpus}", "--out_dir=run", "--init_from=resume", "--n_layer=3"], tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "n_layer: checkpoint has 2, override says 3" in out


def test_weight_decay_reaches_matmul_weights_and_embeddings_only():
    """nanoGPT decays tensors with ndim >= 2 per layer: with stacked blocks that must discount the layer axis."""
    import jax

    from models import gpt
    from purejax import optim, tree
    from train.gpt import decays

    params = gpt.init(jax.random.key(0), gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8))
    mask = tree.flatten(optim.resolve_mask(decays, params))
    assert sorted(p for p, on in mask.items() if on) == [
        "blocks.attn.proj.w",
        "blocks.attn.qkv.w",
        "blocks.mlp.fc.w",
        "blocks.mlp.proj.w",
        "wpe.w",
        "wte.w",
    ]


def test_init_from_a_hugging_face_directory_fine_tunes_it(tmp_path, corpus):
    """--init_from=<dir> loads GPT-2-layout weights (written here by models.gpt_hf.save) and trains them; the
    directory holds no tokenizer, so the char tokenizer stands in, of the model's vocabulary size, with a warning
    (tests/train/test_finetune_gpt2_text.py: a directory with a tokenizer, or a size that differs)."""
    import jax

    from models import gpt, gpt_hf

    vocab_size = len(set(corpus.read_text()))
    config = gpt.GPTConfig(block_size=32, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, bias=True, gelu="tanh")
    gpt_hf.save(gpt.init(jax.random.key(0), config), config, tmp_path / "hf")
    out = finish(
        run_gpt(
            [
                *TINY,
                f"--dataset={corpus}",
                f"--init_from={tmp_path / 'hf'}",
                "--out_dir=ft",
                "--max_iters=4",
                "--eval_interval=1000",
            ],
            tmp_path,
        )
    )
    params, info = checkpoint.restore(tmp_path / "ft" / "ckpt_00000004.msgpack", subtree="params")
    assert info.config["model"]["vocab_size"] == vocab_size and info.config["model"]["gelu"] == "tanh", out
    assert params["wte"]["w"].shape == (vocab_size, 32)
    assert "holds no tokenizer: the ids of the dataset's char tokenizer will not match" in out


def test_resume_eval_only_prints_the_loss_and_the_dtype_may_change(tmp_path, corpus, monkeypatch, capsys):
    """--eval_only on a checkpoint saved at an evaluation still evaluates (and prints) it; a float32 run may
    continue in float16 (a fresh dynamic loss scale joins the state) and go back."""
    from train import gpt

    monkeypatch.chdir(tmp_path)
    common = [*TINY, f"--dataset={corpus}", "--out_dir=run", "--eval_interval=2"]
    gpt.main([*common, "--max_iters=2"])
    evaluations = (tmp_path / "run" / "metrics.jsonl").read_text().count("val_loss")
    result = gpt.main(["--out_dir=run", "--init_from=resume", "--eval_only=true"])
    assert "iter 2: train loss" in capsys.readouterr().out.split("resumed from")[1]
    assert result["iter"] == 2 and result["val_loss"] > 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("val_loss") == evaluations + 1
    assert checkpoint.CheckpointManager(tmp_path / "run").steps() == [2]  # evaluating saves nothing
    gpt.main(["--out_dir=run", "--init_from=resume", "--dtype=float16", "--max_iters=4"])
    assert "loss_scale.counter" in checkpoint.read_metadata(tmp_path / "run" / "ckpt_00000004.msgpack").manifest
    gpt.main(["--out_dir=run", "--init_from=resume", "--dtype=float32", "--max_iters=6"])
    assert "loss_scale.counter" not in checkpoint.read_metadata(tmp_path / "run" / "ckpt_00000006.msgpack").manifest


def test_a_diverging_float16_run_stops_with_an_error_and_logs_strict_json(tmp_path, corpus, monkeypatch):
    """A learning rate far too large sends float16 activations to infinity after the first step; every later
    step is skipped by the loss scale, so the run stops after max_bad_steps with exit status 1."""
    from train import gpt

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        gpt.main(
            [
                *TINY,
                f"--dataset={corpus}",
                "--out_dir=run",
                "--dtype=float16",
                "--decay_lr=false",
                "--learning_rate=1e4",
                "--max_bad_steps=4",
                "--log_interval=1",
                "--eval_interval=1000",
            ]
        )
    assert "had a non-finite loss or gradients and were skipped" in str(e.value) and "diverged" in str(e.value)
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rows = [json.loads(line) for line in text.splitlines() if '"loss"' in line]
    assert rows[-1]["loss"] is None and rows[-1]["skipped"] == 1 and rows[-1]["loss_scale"] < rows[0]["loss_scale"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_up_exits_cleanly(tmp_path, corpus, signum):
    """Sent while the program prepares its data (nothing trained yet): one line, status 128 + signal, no traceback."""
    proc = run_gpt(
        [*TINY, f"--dataset={corpus}", "--out_dir=out", "--peak_flops=0"], tmp_path, env_extra={"PYTHONUNBUFFERED": "1"}
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("preparing"):
            proc.send_signal(signum)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signum, out
    assert "nothing trained yet; exiting" in out and "Traceback" not in out and "compiled" not in out
