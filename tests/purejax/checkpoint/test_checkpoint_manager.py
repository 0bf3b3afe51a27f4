"""CheckpointManager: naming, retention, skipping corrupt files, surviving SIGKILL at every point of a save,
and resuming a training run in a fresh process bit for bit."""

import importlib.util
import os
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from purejax import checkpoint

HERE = Path(__file__).resolve().parent


def load_child(name: str):
    """A child script beside this file, imported as a module (its functions define the expected trees)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def state(step: int) -> dict:
    return {"w": np.full(3, step, np.float32), "step": np.int64(step)}


def test_files_are_named_by_step_and_listed_in_order(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path / "run", keep_last=None)
    for step in [10, 2, 100_000_000]:
        manager.save(step, state(step))
    assert manager.steps() == [2, 10, 100_000_000]
    files = ["ckpt_00000002.msgpack", "ckpt_00000010.msgpack", "ckpt_100000000.msgpack"]
    assert sorted(os.listdir(tmp_path / "run")) == files
    assert manager.latest_step() == 100_000_000
    assert manager.restore(step=10).tree["w"][0] == 10


def test_keep_last_deletes_the_oldest_after_each_save(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        manager.save(step, state(step))
    assert manager.steps() == [4, 5]


@pytest.mark.parametrize("mode, best", [("min", [2, 3]), ("max", [1, 4])])
def test_keep_best_keeps_the_best_by_the_metric_as_well(tmp_path, mode, best):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1, keep_best=2, metric="loss", mode=mode)
    losses = {1: 5.0, 2: 1.0, 3: 2.0, 4: 9.0, 5: float("nan"), 6: 4.0}
    for step, loss in losses.items():
        manager.save(step, state(step), metadata={"loss": loss})
    assert manager.steps() == sorted({*best, 6})  # NaN is never the best


def test_old_files_are_deleted_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, state(1))
    seen = []
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        seen.append((Path(path).name, manager.path(2).exists() and checkpoint.read_metadata(manager.path(2)).step))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    manager.save(2, state(2))
    assert seen == [("ckpt_00000001.msgpack", 2)]


def test_a_corrupt_newest_checkpoint_is_reported_skipped_and_kept(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=3)
    for step in [1, 2, 3]:
        manager.save(step, state(step))
    manager.path(3).write_bytes(manager.path(3).read_bytes()[:-1])  # truncated: the header check notices
    raw = bytearray(manager.path(2).read_bytes())
    raw[-2] ^= 0xFF  # a flipped bit in the last leaf's data: only a full restore notices
    manager.path(2).write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="ckpt_00000003.msgpack, leaf 'w': file is truncated"):
        assert manager.latest_step() == 2
    with pytest.warns(RuntimeWarning) as caught:
        restored = manager.restore(like=state(0))
    assert restored.info.step == 1 and restored.tree["w"][0] == 1
    assert "ckpt_00000003.msgpack" in str(caught[0].message)
    assert "ckpt_00000002.msgpack, leaf 'w'" in str(caught[1].message) and "CRC32" in str(caught[1].message)
    assert len(caught) == 2
    manager.save(4, state(4))
    assert manager.steps() == [1, 2, 3, 4]  # unreadable files are never deleted automatically


def test_restore_returns_none_for_a_new_run_and_refuses_all_corrupt(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=2)
    assert manager.restore() is None and manager.latest_step() is None
    manager.save(1, state(1))
    manager.path(1).write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(checkpoint.CheckpointError, match="no checkpoint .* is readable"):
        manager.restore()


def test_temporary_leftovers_are_removed_on_start_and_ignored_meanwhile(tmp_path):
    leftover = tmp_path / ".ckpt_00000007.msgpack.123-abcd.tmp"
    leftover.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("mine")
    manager = checkpoint.CheckpointManager(tmp_path)
    assert not leftover.exists() and unrelated.exists()
    leftover.write_bytes(b"half a checkpoint")
    assert manager.steps() == [] and manager.restore() is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"keep_last": 0}, "keep_last must be at least 1"),
        ({"keep_best": 1}, "needs a non-negative count and a `metric`"),
        ({"keep_best": 1, "metric": "loss", "mode": "lowest"}, "mode must be 'min'"),
        ({"prefix": ".hidden"}, "prefix '.hidden' must be letters"),
        ({"prefix": "a/b"}, "must be letters"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.CheckpointManager(tmp_path, **kwargs)


def test_keep_best_needs_the_metric_at_save(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_best=1, metric="val_loss")
    with pytest.raises(ValueError, match=r"ranks by metadata\['val_loss'\]: pass a number there, got None"):
        manager.save(1, state(1), metadata={"loss": 1.0})
    assert manager.steps() == []


def test_sigkill_at_every_point_of_a_save_never_loses_the_last_good_checkpoint(tmp_path, run_child):
    """A child process saves step 2 over a directory holding a good step 1 and is SIGKILLed before each of
    its file operations in turn (see crash_child.py). Afterwards every directory holds a checkpoint that
    verifies -- step 1 if the kill came before the rename, step 2 after -- and nothing a new manager trips on."""
    crash = load_child("crash_child")
    good = tmp_path / "step1.msgpack"
    checkpoint.save(good, crash.tree(1), step=1, chunk_bytes=crash.CHUNK_BYTES)
    root = tmp_path / "runs"
    root.mkdir()
    survived_at = int(run_child("crash_child.py", str(root), str(good)).strip())
    assert survived_at >= 15  # writes of the header and 5 records, the fsyncs, the rename and the deletion
    outcomes = []
    for k in range(1, survived_at + 1):
        directory = root / f"k{k:03d}"
        names = os.listdir(directory)
        temporary = [n for n in names if n.startswith(".ckpt_00000002.msgpack.") and n.endswith(".tmp")]
        assert set(names) - set(temporary) <= {"ckpt_00000001.msgpack", "ckpt_00000002.msgpack"}, names
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torn file under a final name would warn
            manager = checkpoint.CheckpointManager(directory, keep_last=1)
            restored = manager.restore(like=crash.tree(0))
        assert [n for n in os.listdir(directory) if n.endswith(".tmp")] == []
        step = restored.info.step
        assert all(np.array_equal(restored.tree[key], value) for key, value in crash.tree(step).items()), k
        outcomes.append(step)
    # Killed before the rename: step 1; from the rename on: step 2; then the old file goes.
    rename = outcomes.index(2)
    assert outcomes == [1] * rename + [2] * (survived_at - rename) and rename >= 10
    assert os.listdir(root / f"k{survived_at:03d}") == ["ckpt_00000002.msgpack"]


def test_resuming_in_a_fresh_process_is_bit_for_bit_the_same_run(tmp_path, run_child):
    """8 steps straight, versus 4 steps, save, then restore in a new process and take the other 4: the
    params, the optimizer state (purejax.optim's AdamW: counts, moments, the scheduled learning rate) and
    the RNG key are identical bit for bit. (resume_child.py can also run optax's AdamW: "optax".)"""
    optimizer = "purejax"
    run = load_child("resume_child")
    straight = run.train(optimizer, run.init_state(optimizer, jax.random.key(0)), 8)
    halfway = run.train(optimizer, run.init_state(optimizer, jax.random.key(0)), 4)
    checkpoint.CheckpointManager(tmp_path).save(4, halfway)
    run_child("resume_child.py", str(tmp_path), optimizer, "8")
    resumed, info = checkpoint.restore(tmp_path / "final.msgpack", like=straight)
    assert info.step == 8
    for name, part in straight.items():
        a, b = jax.tree_util.tree_leaves(part), jax.tree_util.tree_leaves(resumed[name])
        if name == "key":
            a, b = [jax.random.key_data(a[0])], [jax.random.key_data(b[0])]
        assert len(a) == len(b) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b)), name
    assert not np.array_equal(straight["params"]["out"]["w"], halfway["params"]["out"]["w"])  # it did train
