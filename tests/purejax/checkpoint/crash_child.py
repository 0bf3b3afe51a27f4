"""Child process for the crash test: saves killed with SIGKILL at every point, one forked process each.

    python crash_child.py ROOT STEP1_FILE

For k = 1, 2, ...: make ROOT/kNNN holding a copy of the good checkpoint STEP1_FILE (step 1), fork, and in
the forked process save step 2 there with `CheckpointManager(keep_last=1)` while counting its file
operations (writes, fsyncs, the rename, deletions); just before the k-th, the process SIGKILLs itself. Stops
at the first k the save survives, and prints that k. Forking (after importing jax, before any jax backend
exists) rather than starting a process per kill point keeps dozens of kills within seconds.
"""

import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import numpy as np

from purejax import checkpoint
from purejax.checkpoint import fast_write

CHUNK_BYTES = 64


def tree(step: int) -> dict:
    """The checkpointed state at `step`: 160 + 80 bytes, so 3 + 2 records of at most CHUNK_BYTES."""
    return {"w": np.full(40, float(step), np.float32), "b": np.arange(10, dtype=np.int64) * step}


def die_before_operation(k: int) -> None:
    """From now on, count file operations and SIGKILL this process just before the k-th."""
    count = 0

    def counted(function):
        def operation(*args, **kwargs):
            nonlocal count
            count += 1
            if count == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return function(*args, **kwargs)

        return operation

    fast_write._write_at = counted(fast_write._write_at)
    os.fsync, os.replace, os.unlink = counted(os.fsync), counted(os.replace), counted(os.unlink)


def save_step_2(directory: Path, k: int) -> None:
    # Small spans and pieces, so that these tiny records are saved as a large one is: written in pieces by this
    # thread while other threads checksum them span by span; a kill can then land between any two writes.
    fast_write._SPAN_BYTES, fast_write._PIECE_BYTES = 32, 16
    try:
        manager = checkpoint.CheckpointManager(directory, keep_last=1, chunk_bytes=CHUNK_BYTES)
        die_before_operation(k)
        manager.save(2, tree(2))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def main(root: str, step1_file: str) -> None:
    for k in range(1, 1000):
        directory = Path(root) / f"k{k:03d}"
        directory.mkdir()
        shutil.copy(step1_file, directory / "ckpt_00000001.msgpack")
        pid = os.fork()
        if pid == 0:
            save_step_2(directory, k)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            continue
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the save at k={k} failed: {status}"
        print(k)
        return


if __name__ == "__main__":
    main(*sys.argv[1:])
