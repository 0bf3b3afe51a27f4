"""save: atomic replacement, the fsync protocol, bounded memory, and clear errors for what cannot be stored."""

import errno
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import checkpoint
from purejax.checkpoint import fast_write, write
from purejax.checkpoint import format as fmt

HERE = Path(__file__).resolve().parent


def test_save_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "ckpt.msgpack"
    assert checkpoint.save(path, {"w": np.zeros(3)}, step=1) == path
    checkpoint.save(str(path), {"w": np.ones(3)}, step=2)
    assert os.listdir(tmp_path) == ["ckpt.msgpack"]
    restored, info = checkpoint.restore(path)
    assert info.step == 2 and np.array_equal(restored["w"], np.ones(3))


def test_a_failing_save_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.msgpack"
    checkpoint.save(path, {"w": np.zeros(1000)}, step=1)
    writes = []

    def failing_write(fd, data, offset):
        writes.append(len(data))
        if len(writes) == 4:  # after the header and the first records
            raise OSError(28, "No space left on device")
        os.pwrite(fd, data, offset)

    monkeypatch.setattr(fast_write, "_write_at", failing_write)
    monkeypatch.setattr(fast_write, "_PIECE_BYTES", 64)  # 100-byte records: written in pieces, checksummed on threads
    with pytest.raises(checkpoint.CheckpointWriteError) as caught:
        checkpoint.save(path, {"w": np.ones(1000)}, step=2, chunk_bytes=100)
    assert os.listdir(tmp_path) == ["ckpt.msgpack"]
    assert checkpoint.read_metadata(path).step == 1
    # One line naming the file, the bytes it needs (the size the file has when the disk is not full) and the
    # bytes left; still an OSError with the kernel's errno for code that catches those.
    monkeypatch.undo()
    error, written = caught.value, checkpoint.save(tmp_path / "other", {"w": np.ones(1000)}, step=2, chunk_bytes=100)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.path == path
    assert error.needed == written.stat().st_size and error.free is not None
    space = f"it needs {error.needed:,} bytes, {error.free:,} are free"
    assert str(error) == f"cannot write checkpoint {path}: the disk is full: {space}; the file there before is intact"


def test_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        temporary = Path(src).parent == Path(dst).parent and Path(src).name.startswith(".ckpt.msgpack.")
        events.append(f"rename {'temporary' if temporary else src} -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.save(tmp_path / "ckpt.msgpack", {"w": np.zeros(3)})
    assert events == ["fsync file", "rename temporary -> ckpt.msgpack", "fsync dir"]


def test_the_file_is_written_front_to_back_while_other_threads_checksum(tmp_path, monkeypatch):
    """One thread writes every byte once, in order (the disk's fastest pattern), then rewrites the header
    with the checksums; the large records' CRCs are computed on other threads."""
    writes, checksummers = [], set()
    real_write, real_span_crc = fast_write._write_at, fast_write._span_crc

    def recorded_write(fd, data, offset):
        writes.append((offset, len(memoryview(data).cast("B")), threading.current_thread().name))
        real_write(fd, data, offset)

    def recorded_span_crc(span):
        checksummers.add(threading.current_thread().name)
        return real_span_crc(span)

    monkeypatch.setattr(fast_write, "_write_at", recorded_write)
    monkeypatch.setattr(fast_write, "_span_crc", recorded_span_crc)
    monkeypatch.setattr(fast_write, "_PIECE_BYTES", 256)
    monkeypatch.setattr(fast_write, "_SPAN_BYTES", 1000)
    path = tmp_path / "ckpt.msgpack"
    tree = {"a": np.arange(1000, dtype=np.float32), "b": np.arange(10), "c": np.ones((30, 40))}
    checkpoint.save(path, tree, chunk_bytes=3000)
    *body, last = writes
    assert [offset for offset, _, _ in body] == list(np.cumsum([0] + [n for _, n, _ in body[:-1]]))
    assert body[-1][0] + body[-1][1] == path.stat().st_size
    assert last[0] == 0 and last[1] == checkpoint.read_metadata(path).manifest["a"].offset  # preamble + header
    assert {name for _, _, name in writes} == {threading.current_thread().name}
    assert checksummers and threading.current_thread().name not in checksummers
    restored = checkpoint.restore(path).tree
    assert all(np.array_equal(restored[k], tree[k]) for k in tree)


def arbitrary(name: str, shape: tuple, seed: int) -> np.ndarray:
    """Arbitrary bytes of dtype `name` (for the narrow dtypes only in their value bits)."""
    dtype = fmt.DTYPES[name]
    raw = np.random.default_rng(seed).integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    raw &= (1 << fmt.VALUE_BITS.get(name, 8)) - 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("chunk_bytes", [7, 64, 2**20])
def test_the_fast_and_the_reference_path_write_the_same_bytes(tmp_path, monkeypatch, chunk_bytes):
    """save() (one writing thread, others checksumming, fast_write.py) and save(threads=False) (one thread
    front to back, sequential.py) write identical files: every dtype, records cut through elements, large
    records checksummed in several spans; and either reader restores either file."""
    monkeypatch.setattr(write, "_now", lambda: "2025-01-01T00:00:00+00:00")  # the one thing that would differ
    monkeypatch.setattr(fast_write, "_PIECE_BYTES", 16)  # so 64-byte records are "large": spans on other threads
    monkeypatch.setattr(fast_write, "_SPAN_BYTES", 24)
    tree = {
        "dtypes": {name: arbitrary(name, (7, 5), i) for i, name in enumerate(fmt.DTYPES)},
        "nodes": [None, (np.zeros(0, np.float32), 3, 2.5), {1: jax.random.key(1), 0: np.bool_(True)}],
    }
    fast = checkpoint.save(tmp_path / "fast", tree, step=3, config={"lr": 0.1}, chunk_bytes=chunk_bytes)
    reference = checkpoint.save(
        tmp_path / "reference", tree, step=3, config={"lr": 0.1}, chunk_bytes=chunk_bytes, threads=False
    )
    assert fast.read_bytes() == reference.read_bytes()
    saved = leaf_bytes(tree)
    assert leaf_bytes(checkpoint.restore(fast, threads=False).tree) == saved
    assert leaf_bytes(checkpoint.restore(reference).tree) == saved


def leaf_bytes(tree) -> list[bytes]:
    """Each leaf's bytes (a typed key's: its key data), in leaf order."""
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    return [np.asarray(jax.random.key_data(x) if is_key(x) else x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_temporary_names_are_hidden_unique_and_recognisable(tmp_path):
    a, b = write.temp_path(tmp_path / "ckpt_00000001.msgpack"), write.temp_path(tmp_path / "ckpt_00000001.msgpack")
    assert a != b and a.parent == tmp_path
    assert a.name.startswith(".ckpt_00000001.msgpack.") and a.name.endswith(write.TEMP_SUFFIX)
    assert write.temp_owner(a.name) == ("ckpt_00000001.msgpack", os.getpid())
    assert write.temp_owner("ckpt_00000001.msgpack") is None and write.temp_owner(".x.12-nothex!.tmp") is None


def test_big_endian_numpy_arrays_are_stored_little_endian(tmp_path):
    values = np.arange(5, dtype=">f4")
    checkpoint.save(tmp_path / "f", {"x": values})
    restored = checkpoint.restore(tmp_path / "f").tree["x"]
    assert restored.dtype == np.dtype("<f4") and np.array_equal(restored, values)


@pytest.mark.parametrize(
    "tree, kwargs, error, message",
    [
        ({"w": np.array([object()])}, {}, TypeError, "leaf 'w': dtype object cannot be stored"),
        ({"names": np.array(["a"])}, {}, TypeError, "leaf 'names': dtype <U1 cannot be stored"),
        ({"a.b": np.ones(1), "a": {"b": np.ones(1)}}, {}, ValueError, "two leaves share the dotted path 'a.b'"),
        ({"w": np.ones(1)}, {"step": jnp.array(1.5)}, TypeError, r"step must be an integer scalar, got float32\[\]"),
        ({"w": np.ones(1)}, {"step": jnp.arange(2)}, TypeError, r"step must be an integer scalar, got int32\[2\]"),
        ({"w": np.ones(1)}, {"config": {"act": print}}, TypeError, "config.act is a builtin_function_or_method"),
        ({"w": np.ones(1)}, {"metadata": {"loss": jnp.ones(2)}}, TypeError, "metadata.loss is a ArrayImpl"),
        ({"w": np.ones(1)}, {"chunk_bytes": 0}, ValueError, "chunk_bytes must be in 1..1073741824"),
        ({"w": np.ones(1)}, {"chunk_bytes": 2**30 + 1}, ValueError, "chunk_bytes must be in"),
    ],
)
def test_what_cannot_be_saved_is_refused_before_writing(tmp_path, tree, kwargs, error, message):
    with pytest.raises(error, match=message):
        checkpoint.save(tmp_path / "f", tree, **kwargs)
    assert os.listdir(tmp_path) == []


def test_step_accepts_numpy_and_jax_integers(tmp_path):
    for step in [np.int64(7), jnp.array(7, jnp.int32), 7]:
        checkpoint.save(tmp_path / "f", {}, step=step)
        assert checkpoint.read_metadata(tmp_path / "f").step == 7


def test_save_adds_at_most_one_chunk_of_memory(big_checkpoint):
    """240 MB of jax arrays saved in 16 MiB chunks (in a fresh process, see peak_memory.py): the peak RSS
    grows by less than one chunk. A whole-file bytes object, flax's way, would add 240 MB or more."""
    _, measured = big_checkpoint
    assert measured["data"] == 240 * 2**20
    assert measured["extra"] < measured["chunk_bytes"], measured


def test_a_header_readers_would_refuse_is_refused_at_save(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.format, "MAX_HEADER_BYTES", 2000)
    layers = [{"w": np.ones(1), "b": np.ones(1)} for _ in range(50)]
    with pytest.raises(ValueError, match=r"over the 2,000 readers accept: 100 leaves, config and metadata"):
        checkpoint.save(tmp_path / "f", layers)
    assert os.listdir(tmp_path) == []


def test_two_processes_save_once_and_both_restore(tmp_path):
    """A real two-process run (jax.distributed on this machine): arrays spanning both processes are gathered,
    process 0 writes, both restore; when process 0 cannot write, both raise. See multiprocess_child.py."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    children = [
        subprocess.Popen(
            [sys.executable, str(HERE / "multiprocess_child.py"), str(i), str(port), str(tmp_path)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=120) for child in children]
    finally:
        for child in children:
            child.kill()  # only still running if the other one failed and left it waiting
    for i, (child, (out, err)) in enumerate(zip(children, outputs)):
        assert child.returncode == 0 and out.strip().endswith("ok"), f"process {i}:\n{err[-4000:]}"
    assert sorted(os.listdir(tmp_path)) == ["ckpt.msgpack"]
