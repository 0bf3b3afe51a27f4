"""A save onto a full disk: on a real 1 MiB tmpfs, the old checkpoint stays, no temporary file is left, and the
error is one line naming the file, the bytes it needs, the bytes left and (from the manager) the last good
checkpoint. (The unit test of the same, without a mount, is in test_checkpoint_write.py.)"""

import errno
import os
import shutil
import subprocess

import numpy as np
import pytest

from purejax import checkpoint


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a fresh 1 MiB tmpfs (mounting needs root: skipped otherwise); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small disk with")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root): {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# The reference path with small records fills its write buffer: closing the file after the failure flushes it,
# which fails again, and used to skip removing the temporary file.
@pytest.mark.parametrize("threads, chunk_bytes", [(True, 2**28), (False, 2**28), (False, 4096)])
def test_a_save_onto_a_full_disk_keeps_the_old_file_and_says_so_in_one_line(small_disk, tmp_path, threads, chunk_bytes):
    path = small_disk / "ckpt.msgpack"
    checkpoint.save(path, {"w": np.zeros(1000, np.float32)}, step=1)
    big = {"w": np.ones(2**19, np.float32)}  # 2 MiB, on a 1 MiB disk
    with pytest.raises(checkpoint.CheckpointWriteError) as caught:
        checkpoint.save(path, big, step=2, threads=threads, chunk_bytes=chunk_bytes)
    error = caught.value
    assert os.listdir(small_disk) == ["ckpt.msgpack"]  # the temporary file is gone
    assert checkpoint.read_metadata(path).step == 1
    written = checkpoint.save(tmp_path / "big", big, step=2, chunk_bytes=chunk_bytes)  # on the ordinary disk
    assert error.errno == errno.ENOSPC and error.needed == written.stat().st_size
    assert error.free == shutil.disk_usage(small_disk).free < error.needed
    expected = f"it needs {error.needed:,} bytes, {error.free:,} are free; the file there before is intact"
    assert str(error) == f"cannot write checkpoint {path}: the disk is full: {expected}"


def test_the_manager_names_the_last_good_checkpoint(small_disk, tmp_path):
    manager = checkpoint.CheckpointManager(small_disk, keep_last=2)
    manager.save(1, {"w": np.zeros(1000, np.float32)})
    big = {"w": np.ones(2**19, np.float32)}
    with pytest.raises(checkpoint.CheckpointWriteError) as caught:
        manager.save(2, big)
    error = caught.value
    assert error.path == manager.path(2) and error.last_good == manager.path(1)
    assert str(error).endswith(f"are free; the last good checkpoint is {manager.path(1)}") and "\n" not in str(error)
    assert manager.steps() == [1] and os.listdir(small_disk) == [manager.path(1).name]
    assert (manager.restore().tree["w"] == 0).all()


def test_a_manager_with_no_checkpoint_yet_says_so(small_disk):
    manager = checkpoint.CheckpointManager(small_disk / "run")
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"run has no checkpoint yet$") as caught:
        manager.save(1, {"w": np.ones(2**19, np.float32)})
    assert caught.value.last_good is None and os.listdir(small_disk / "run") == []
