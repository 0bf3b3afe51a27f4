"""CheckpointManager: naming, retention, skipping corrupt files, surviving SIGKILL at every point of a save,
and resuming a training run in a fresh process bit for bit."""

import builtins
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from purejax import checkpoint
from purejax.checkpoint import fast_write
from purejax.checkpoint import manager as manager_lib

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


def finished_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_readers_never_delete_and_a_save_removes_only_stale_temporaries(tmp_path):
    """Constructing a manager and reading change nothing (a sampler beside a training run used to delete
    the run's temporary file mid-save). A save removes the temporaries of processes that are gone, and
    those nobody has written to for an hour; never a live process's, nor this process's own."""
    old = time.time() - 2 * 3600
    temporaries = {
        "dead": (f".ckpt_00000007.msgpack.{finished_pid()}-0123abcd.tmp", None),
        "live": (f".ckpt_00000008.msgpack.{os.getppid()}-0123abcd.tmp", None),
        "live but untouched": (f".ckpt_00000009.msgpack.{os.getppid()}-4567abcd.tmp", old),
        "this process's": (f".ckpt_00000010.msgpack.{os.getpid()}-89abcdef.tmp", old),
        "another prefix's": (f".best_00000007.msgpack.{finished_pid()}-0123abcd.tmp", None),
    }
    for name, mtime in temporaries.values():
        (tmp_path / name).write_bytes(b"half a checkpoint")
        if mtime:
            os.utime(tmp_path / name, (mtime, mtime))
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    manager = checkpoint.CheckpointManager(tmp_path)
    assert manager.steps() == [] and manager.restore() is None and manager.latest_step() is None
    assert sorted(os.listdir(tmp_path)) == before
    manager.save(1, state(1))
    kept = [temporaries[k][0] for k in ("live", "this process's", "another prefix's")]
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "ckpt_00000001.msgpack", "notes.txt"])


def test_a_reader_in_the_middle_of_a_save_leaves_it_alone(tmp_path, monkeypatch):
    """The reported crash: a manager made while a save is writing (train.sample beside train.gpt) deleted the
    save's temporary file, and the save failed at the rename with FileNotFoundError."""
    writer = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    writer.save(1, state(1))
    seen, real_write = [], fast_write._write_at

    def write_then_read(fd, data, offset):
        real_write(fd, data, offset)
        if not seen:  # the temporary file of step 2 exists now
            reader = checkpoint.CheckpointManager(tmp_path, keep_last=None)
            seen.append((reader.latest_step(), reader.restore().info.step))

    monkeypatch.setattr(fast_write, "_write_at", write_then_read)
    writer.save(2, state(2))
    assert seen == [(1, 1)] and writer.steps() == [2]


def test_a_checkpoint_pruned_while_a_reader_looks_is_passed_over_for_the_newer_one(tmp_path, monkeypatch):
    writer = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    writer.save(5, state(5))
    real_restore = manager_lib.restore

    def save_meanwhile(path, *args, **kwargs):
        if writer.steps() == [5]:
            writer.save(6, state(6))  # and prunes step 5, which the reader has just listed
        return real_restore(path, *args, **kwargs)

    monkeypatch.setattr(manager_lib, "restore", save_meanwhile)
    assert checkpoint.CheckpointManager(tmp_path).restore().info.step == 6


def test_a_directory_or_fifo_named_like_a_checkpoint_is_passed_over(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, state(1))
    (tmp_path / "ckpt_00000009.msgpack").mkdir()  # used to raise IsADirectoryError in all three below
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "ckpt_00000008.msgpack")  # opening it would wait for a writer for ever
    assert manager.steps() == [1] and manager.latest_step() == 1 and manager.restore().info.step == 1
    manager.save(2, state(2))
    assert manager.steps() == [2] and (tmp_path / "ckpt_00000009.msgpack").is_dir()


def test_an_unreadable_newest_file_is_skipped_with_a_warning(tmp_path, monkeypatch):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        manager.save(step, state(step))
    denied = str(manager.path(2))  # as if chmod 000 (the tests may run as root, who can read anything)
    real_os_open, real_open = os.open, builtins.open

    def refuse(opener):
        def open_unless_denied(path, *args, **kwargs):
            if str(path) == denied:
                raise PermissionError(13, "Permission denied", denied)
            return opener(path, *args, **kwargs)

        return open_unless_denied

    monkeypatch.setattr(os, "open", refuse(real_os_open))
    monkeypatch.setattr(builtins, "open", refuse(real_open))
    reader = checkpoint.CheckpointManager(tmp_path)
    with pytest.warns(RuntimeWarning, match="ckpt_00000002.msgpack: cannot be opened: Permission denied"):
        assert reader.latest_step() == 1
    with pytest.warns(RuntimeWarning, match="ckpt_00000002.msgpack: cannot be opened"):
        assert reader.restore().info.step == 1


def test_a_damaged_file_is_read_once_not_on_every_save(tmp_path, monkeypatch):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, state(1))
    manager.path(1).write_bytes(b"garbage")
    reads, real_read = [], manager_lib.read_metadata
    monkeypatch.setattr(manager_lib, "read_metadata", lambda path: reads.append(Path(path).name) or real_read(path))
    for step in range(2, 6):
        manager.save(step, state(step))
    assert manager.steps() == [1, 4, 5]
    assert sorted(reads) == [f"ckpt_{s:08d}.msgpack" for s in range(1, 6)]  # each file once


def test_an_explicit_step_that_is_not_there_is_named_with_the_steps_that_are(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=None)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint for step 3; the directory has none"):
        manager.restore(step=3)
    for step in range(1, 13):
        manager.save(step, state(step))
    listed = r"no checkpoint for step 999; the directory has steps 1, 2, 3, \.\.\., 8, 9, 10, 11, 12 \(12 in all\)"
    with pytest.raises(checkpoint.CheckpointError, match=listed):
        manager.restore(step=999)


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


def test_train_sample_falls_back_past_a_damaged_newest_checkpoint(tmp_path):
    """train.sample reads the params of the newest checkpoint that verifies, as its docstring promises (the
    header check alone passed a file whose params were damaged, and sampling then failed)."""
    from models import gpt
    from train import sample

    model = dataclasses.asdict(gpt.GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=2, n_embd=16))
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        tree = {"params": {"w": np.full(64, step, np.float32)}, "opt_state": np.zeros(3)}
        manager.save(step, tree, config={"model": model})
    raw = bytearray(manager.path(2).read_bytes())
    raw[checkpoint.read_metadata(manager.path(2)).manifest["params.w"].offset + 100] ^= 0x40
    manager.path(2).write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="ckpt_00000002.msgpack, leaf 'params.w'.*CRC32"):
        params, config, step = sample.load_model(tmp_path)
    assert step == 1 and params["w"][0] == 1 and config.n_embd == 16


def test_sigkill_at_every_point_of_a_save_never_loses_the_last_good_checkpoint(tmp_path, run_child):
    """A child process saves step 2 over a directory holding a good step 1 and is SIGKILLed before each of
    its file operations in turn (see crash_child.py). Afterwards every directory holds a checkpoint that
    verifies -- step 1 if the kill came before the rename, step 2 after -- and nothing a new manager trips on;
    the next save removes the temporary file the killed one left."""
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
        assert sorted(os.listdir(directory)) == sorted(names)  # reading removed nothing
        step = restored.info.step
        assert all(np.array_equal(restored.tree[key], value) for key, value in crash.tree(step).items()), k
        outcomes.append(step)
        manager.save(3, crash.tree(3))  # a writer: removes the killed process's temporary file
        assert os.listdir(directory) == ["ckpt_00000003.msgpack"], k
    # Killed before the rename: step 1; from the rename on: step 2; then the old file goes.
    rename = outcomes.index(2)
    assert outcomes == [1] * rename + [2] * (survived_at - rename) and rename >= 10
    assert names == ["ckpt_00000002.msgpack"]  # the save that survived: its temporary renamed, step 1 pruned


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
