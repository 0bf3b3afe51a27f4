"""`save`: stream a tree into one checkpoint file, atomically and durably.

Memory: each leaf goes from the array's own memory to the file, one record per chunk (`np.asarray` of an
array on one CPU device is a view, and the bytes are written from that view); no bytes object of the whole
file is ever built. So a save needs no extra memory for arrays on one CPU device, and one leaf's worth at a
time for arrays that must first be gathered (sharded) or copied from an accelerator.

Atomicity: the file is written under a temporary name in the same directory, flushed and fsynced, renamed
over the final name, and the directory is fsynced so that the rename itself survives a power cut. A crash at
any moment leaves the old file or the new one under the final name, never a torn one. Temporary names
(`.NAME.PID-RANDOM.tmp`) start with a dot and end in `.tmp`; `CheckpointManager` removes leftovers.

Speed: the file is written front to back by one thread, from the arrays' memory in pieces of 512 KiB (each
copy into the page cache stays within the CPU's cache), with the disk told to start writing every 64 MiB
rather than at the final fsync. The CRC-32s, which cost about as much CPU as the copies, are computed at the
same time by other threads, 8 MiB at a time; the header, written first with the checksums zeroed, is
rewritten in place once they are known (it has a fixed length: every checksum is a 4-byte bin), and only
then is the file renamed into place. So on two cores a save runs at the speed of a plain write of the bytes
plus fsync; docs/benchmarks.md has the measurements behind each choice.
"""

import datetime
import os
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import jax
import msgpack
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Array

import purejax
from purejax import tree as tree_lib
from purejax.checkpoint import format as fmt
from purejax.checkpoint import nodes
from purejax.checkpoint.crc import crc32_of_pieces

PyTree = Any
TEMP_SUFFIX = ".tmp"
_CHECKSUM_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # beside the thread that writes
_SPAN_BYTES = 8 * 2**20  # what one checksum thread takes at a time
_PIECE_BYTES = 512 * 2**10  # one write; also the size below which a record is checksummed by the writer
_WRITEBACK_BYTES = 64 * 2**20  # how often the disk is told to start on what has been written


def save(
    path: str | os.PathLike,
    tree: PyTree,
    *,
    step: int | np.integer | Array | None = None,
    config: Any = None,
    metadata: dict[str, Any] | None = None,
    chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
) -> Path:
    """Write `tree` (and `step`, `config`, `metadata`) to the checkpoint file `path`; returns the path.

    Arguments:
        path: the file to write; its directory must exist. An existing file is replaced atomically.
        tree: dicts (str or int keys), lists, tuples, NamedTuples and None over jax or numpy arrays of any
            dtype (typed PRNG keys included) and scalars. Python scalars are stored as 0-d numpy arrays.
        step: the training step, readable without loading arrays (`read_metadata(path).step`).
        config: plain data (dicts, lists, numbers, strings; a dataclass is stored as a dict of its fields).
        metadata: a dict of plain data, e.g. `{"val_loss": 2.1}` (what `CheckpointManager` ranks by).
        chunk_bytes: the largest record; leaves above it are split. At most `MAX_CHUNK_BYTES` (1 GiB).

    Multi-process: call it on every process with the same tree. Arrays that span processes are gathered
    one at a time with `multihost_utils.process_allgather` (a collective, so every process must take part);
    other leaves are taken from process 0, which alone writes the file. Every process returns only once the
    file is durable, so any of them can read it next; if process 0 fails to write it, every process raises.
    """
    path = Path(path)
    if not 0 < chunk_bytes <= fmt.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{fmt.MAX_CHUNK_BYTES} (1 GiB), got {chunk_bytes}")
    tree_lib.flatten(tree)  # ValueError if two leaves share a dotted path
    node, leaves = nodes.encode(tree)
    leaves = [(name, *_storable(x)) for name, x in leaves]
    entries = [_manifest_entry(name, x, impl, chunk_bytes) for name, x, impl in leaves]
    header = fmt.header_dict(
        purejax_version=purejax.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        step=None if step is None else _step(step),
        config=fmt.plain(config, "config"),
        metadata=fmt.plain(dict(metadata or {}), "metadata"),
        chunk_bytes=chunk_bytes,
        tree=node,
        leaves=entries,
    )
    if (header_bytes := len(msgpack.packb(header, use_bin_type=True))) > fmt.MAX_HEADER_BYTES:
        raise ValueError(
            f"the checkpoint header would be {header_bytes:,} bytes, over the {fmt.MAX_HEADER_BYTES:,} readers accept: "
            f"{len(leaves):,} leaves, config and metadata; stack repeated layers into single arrays, or shrink them"
        )
    if jax.process_count() == 1:
        with _atomic_file(path) as f:
            _write_file(f, header, map(_to_host, [x for _, x, _ in leaves]))
        return path
    return _save_from_process_0(path, header, [x for _, x, _ in leaves])


def _save_from_process_0(path: Path, header: dict[str, Any], arrays: list[Any]) -> Path:
    """The multi-process save: every process takes part in each leaf's gather, in manifest order, one leaf
    at a time; process 0 writes the file. Then process 0 broadcasts whether it succeeded, which is also the
    barrier: no process returns before the file is durable, and if process 0 failed (a full disk, a missing
    directory) every process raises instead of one raising and the others waiting forever in a collective."""
    remaining = iter(arrays)  # shared with the writer, so after a failure the rest can still be gathered
    failure = None
    if jax.process_index() == 0:
        try:
            with _atomic_file(path) as f:
                _write_file(f, header, (_to_host(x) for x in remaining))
        except Exception as e:  # re-raised below, once the other processes have been told
            failure = e
    for x in remaining:  # other processes: all leaves; process 0: those after a failure
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            _to_host(x)  # take part in the gather (a collective), then drop the copy
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(failure is None)))
    if failure is not None:
        raise failure
    if not ok:
        raise RuntimeError(f"process 0 failed to write the checkpoint {path} (its own log has the error)")
    return path


def _write_file(f, header: dict[str, Any], arrays: Iterator[np.ndarray]) -> None:
    """Header (checksums zeroed), every leaf's records, then the header again with the checksums. `arrays`
    are the leaves as host arrays (`_to_host`), taken one at a time as each is written.

    This thread writes the file front to back (`_SequentialWrites`), at the pace of a plain copy of the
    bytes, while `_CHECKSUM_THREADS` other threads compute the large records' CRC-32s span by span
    (`_SPAN_BYTES`), combined into each record's (`crc32_of_pieces`); small records are checksummed here. A
    leaf's checksums are collected before the next leaf is taken, so at most one leaf is held beyond the
    tree itself. On two cores the checksums then cost no time on a disk-bound save (docs/benchmarks.md)."""
    fd = f.fileno()
    placeholder = msgpack.packb(header, use_bin_type=True)
    out = _SequentialWrites(fd)
    out.write(fmt.pack_preamble(len(placeholder), zlib.crc32(placeholder)) + placeholder)
    pool = ThreadPoolExecutor(max_workers=_CHECKSUM_THREADS, thread_name_prefix="purejax-checksum")
    try:
        for entry, x in zip(header["leaves"], arrays, strict=True):
            data, records, start = x.reshape(-1).view(np.uint8), [], 0
            for size in fmt.chunk_sizes(data.nbytes, header["chunk_bytes"]):
                record = data[start : start + size]
                if size < _PIECE_BYTES:
                    records.append([(size, zlib.crc32(record))])
                else:
                    spans = [record[i : i + _SPAN_BYTES] for i in range(0, size, _SPAN_BYTES)]
                    records.append([pool.submit(_span_crc, span) for span in spans])
                out.write(fmt.pack_record_prefix(size))
                out.write(record)
                start += size
            entry["crc32"] = np.asarray([_record_crc(spans) for spans in records], "<u4").tobytes()
    finally:  # after an error (or Ctrl-C), skip the spans not started and wait for those running
        pool.shutdown(wait=True, cancel_futures=True)
    out.flush()
    final = msgpack.packb(header, use_bin_type=True)
    assert len(final) == len(placeholder), "the header changed length when its checksums were filled in"
    _write_at(fd, fmt.pack_preamble(len(final), zlib.crc32(final)) + final, 0)


def _span_crc(span: np.ndarray) -> tuple[int, int]:
    return span.nbytes, zlib.crc32(span)


class _SequentialWrites:
    """Writes the file front to back: small pieces (record prefixes, small records) gathered into writes of
    about `_PIECE_BYTES`, large ones written from their own memory in pieces of `_PIECE_BYTES` (each copy
    into the page cache stays within the CPU's cache). Every `_WRITEBACK_BYTES` the kernel is asked to start
    writing what came before to disk (`_start_writeback`), so the disk works during the writes instead of
    all at the final fsync."""

    def __init__(self, fd: int):
        self.fd, self.offset, self.started, self.pending = fd, 0, 0, bytearray()

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if len(view) < _PIECE_BYTES:
            self.pending += view
            if len(self.pending) >= _PIECE_BYTES:
                self.flush()
            return
        self.flush()
        for begin in range(0, len(view), _PIECE_BYTES):
            self._write(view[begin : begin + _PIECE_BYTES])

    def flush(self) -> None:
        if self.pending:
            self._write(self.pending)
            self.pending = bytearray()

    def _write(self, data: Any) -> None:
        _write_at(self.fd, data, self.offset)
        self.offset += len(data)
        if self.offset - self.started >= _WRITEBACK_BYTES:
            _start_writeback(self.fd, self.started, self.offset - self.started)
            self.started = self.offset


def _record_crc(spans: list) -> int:
    """A record's CRC-32 from its spans' `(length, CRC-32)`, or futures of them, in order."""
    return crc32_of_pieces(span.result() if hasattr(span, "result") else span for span in spans)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes `offset..offset + nbytes` to disk now, and to not keep them
    cached. Without this the disk idles until the final fsync, which then writes the whole file while the
    CPU waits; with it the disk works while the next spans are checksummed and copied. (On Linux,
    `POSIX_FADV_DONTNEED` starts writeback of dirty pages; elsewhere it is a hint or absent.)"""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _write_at(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` at file offset `offset` (no shared file position, so threads may call it at once).
    Its own function so the crash tests can stop a save between any two writes."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@contextmanager
def _atomic_file(path: Path):
    """An open binary file that appears under `path`, fsynced, only when the `with` block succeeds."""
    tmp = temp_path(path)
    f = open(tmp, "xb", buffering=2**20)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside `path`: hidden, unique to this process, and ending in `TEMP_SUFFIX`."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")


def fsync_dir(directory: Path) -> None:
    """Make the renames and deletions in `directory` durable (a no-op where directories cannot be opened)."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storable(x: Any) -> tuple[Any, str | None]:
    """`(array, key_impl)`: a typed PRNG key becomes its key data and implementation name; a Python or
    numpy scalar a 0-d numpy array; jax and numpy arrays stay as they are (nothing is copied yet)."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x), str(jax.random.key_impl(x))
        return x, None
    return (x if isinstance(x, np.ndarray) else np.asarray(x)), None


def _manifest_entry(name: str, x: Any, key_impl: str | None, chunk_bytes: int) -> dict[str, Any]:
    try:
        dtype = fmt.dtype_name(x.dtype)
    except TypeError as e:
        raise TypeError(f"leaf {name!r}: {e}") from None
    nbytes = int(np.prod(x.shape, dtype=np.int64)) * fmt.DTYPES[dtype].itemsize
    n_chunks = len(fmt.chunk_sizes(nbytes, chunk_bytes))
    return {
        "path": name, "dtype": dtype, "shape": list(x.shape), "nbytes": nbytes,
        "crc32": bytes(4 * n_chunks), "key_impl": key_impl,
    }  # fmt: skip


def _to_host(x: Any) -> np.ndarray:
    """A C-contiguous little-endian numpy array holding `x`'s global value (a view where `x` is already one
    host buffer, otherwise one leaf's worth of new memory).

    A jax array is copied shard by shard: `np.asarray` (and `jax.device_put` to one device) of a sharded or
    GPU array caches the host copy on the caller's array for its lifetime, which would leave the whole tree
    duplicated in host memory after a save."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        elif len(x.sharding.device_set) == 1:
            x = _single_device_to_host(x)
        else:
            host = np.empty(x.shape, x.dtype)
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    host[shard.index] = _single_device_to_host(shard.data)
            x = host
    x = np.asarray(x)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    return np.ascontiguousarray(x)


def _single_device_to_host(x: Array) -> np.ndarray:
    """A view of a CPU array; for an accelerator array, a copy made through a temporary CPU array."""
    if next(iter(x.sharding.device_set)).platform == "cpu":
        return np.asarray(x)
    return np.asarray(jax.device_put(x, jax.local_devices(backend="cpu")[0]))


def _step(step: Any) -> int:
    if np.ndim(step) != 0 or not np.issubdtype(np.asarray(step).dtype, np.integer):
        raise TypeError(f"step must be an integer scalar, got {tree_lib.describe(step)}")
    return int(step)
