"""`save`: stream a tree into one checkpoint file, atomically and durably.

What it does, in order: check that the tree can be stored (node kinds, dtypes, the header's size) before
touching the disk; build the header (nodes.py, header.py); then write the bytes -- by default with the fast
path (fast_write.py), with `threads=False` with the reference path (sequential.py), the same bytes either
way -- into a temporary file, and put that in place.

Memory: each leaf goes from the array's own memory to the file, one record per chunk (`np.asarray` of an
array on one CPU device is a view, and the bytes are written from that view); no bytes object of the whole
file is ever built. So a save needs no extra memory for arrays on one CPU device, and one leaf's worth at a
time for arrays that must first be gathered (sharded) or copied from an accelerator.

Atomicity: the file is written under a temporary name in the same directory, flushed and fsynced, renamed
over the final name, and the directory is fsynced so that the rename itself survives a power cut. A crash at
any moment leaves the old file or the new one under the final name, never a torn one, and a reader never
sees a partial file. Temporary names (`.NAME.PID-RANDOM.tmp`) start with a dot and end in `.tmp`; those a
killed save leaves behind are removed by the next `CheckpointManager.save` in that directory.

A full disk (or quota): the temporary file is removed, the old file stays, and `save` raises
`CheckpointWriteError` (an OSError) whose one-line message names the file, the bytes it needs and the bytes
left, instead of msgpack's or the kernel's bare `[Errno 28]`.
"""

import contextlib
import datetime
import errno
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Array

import purejax
from purejax import tree as tree_lib
from purejax.checkpoint import fast_write, nodes, sequential
from purejax.checkpoint import format as fmt
from purejax.checkpoint.header import encode_header, header_dict, parse_header, plain

PyTree = Any
TEMP_SUFFIX = ".tmp"
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # EDQUOT: a user's quota, where there is one
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d{1,10})-[0-9a-f]{8}\.tmp")  # what temp_path makes


def save(
    path: str | os.PathLike,
    tree: PyTree,
    *,
    step: int | np.integer | Array | None = None,
    config: Any = None,
    metadata: dict[str, Any] | None = None,
    chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
    threads: bool = True,
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
        threads: write with the fast path (one writing thread, others checksumming); False: with the
            reference path, one thread front to back (sequential.py). The file is the same either way.

    Raises CheckpointWriteError when the disk is full (see the module's docstring), ValueError or TypeError
    for a tree, config or metadata a checkpoint cannot hold (before anything is written).

    Multi-process: call it on every process with the same tree. Arrays that span processes are gathered
    one at a time with `multihost_utils.process_allgather` (a collective, so every process must take part);
    other leaves are taken from process 0, which alone writes the file. Every process returns only once the
    file is durable, so any of them can read it next; if process 0 fails to write it, every process raises.
    """
    path = Path(path)
    if not 0 < chunk_bytes <= fmt.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{fmt.MAX_CHUNK_BYTES} (1 GiB), got {chunk_bytes}")
    node, leaves = nodes.encode(tree)  # TypeError or ValueError for what a checkpoint cannot hold, by path
    tree_lib.flatten(tree)  # ValueError if two leaves share a dotted path
    leaves = [(name, *_storable(x)) for name, x in leaves]
    entries = [_manifest_entry(name, x, impl, chunk_bytes) for name, x, impl in leaves]
    header = header_dict(
        purejax_version=purejax.__version__,
        created=_now(),
        step=None if step is None else _step(step),
        config=plain(config, "config"),
        metadata=plain(dict(metadata or {}), "metadata"),
        chunk_bytes=chunk_bytes,
        tree=node,
        leaves=entries,
    )
    encoded = encode_header(header)
    if (header_bytes := len(encoded) - fmt.PREAMBLE_SIZE) > fmt.MAX_HEADER_BYTES:
        raise ValueError(
            f"the checkpoint header would be {header_bytes:,} bytes, over the {fmt.MAX_HEADER_BYTES:,} readers accept: "
            f"{len(leaves):,} leaves, config and metadata; stack repeated layers into single arrays, or shrink them"
        )
    n_records = sum(fmt.n_records(entry["nbytes"], chunk_bytes) for entry in entries)
    size = len(encoded) + sum(entry["nbytes"] for entry in entries) + fmt.RECORD_PREFIX_SIZE * n_records  # the file's
    _check_readable(path, encoded, size)
    write_file = fast_write.write_file if threads else sequential.write_file
    if jax.process_count() == 1:
        with _atomic_file(path, size) as f:
            write_file(f, header, map(_to_host, [x for _, x, _ in leaves]))
        return path
    return _save_from_process_0(path, header, [x for _, x, _ in leaves], write_file, size)


def _check_readable(path: Path, encoded: bytes, size: int) -> None:
    """ValueError unless readers would accept this header: it is read here with their own code (header.py),
    so every limit a reader enforces -- above all the memory its config and metadata decode to -- holds for
    every file `save` writes."""
    try:
        parse_header(encoded[fmt.PREAMBLE_SIZE :], path, len(encoded), size)
    except fmt.CheckpointError as e:
        raise ValueError(
            f"readers would refuse this checkpoint: {e.problem} (config and metadata are for settings "
            "and numbers; put large data in the tree, as arrays)"
        ) from None


def _save_from_process_0(path: Path, header: dict[str, Any], arrays: list[Any], write_file, size: int) -> Path:
    """The multi-process save: every process takes part in each leaf's gather, in manifest order, one leaf
    at a time; process 0 writes the file. Then process 0 broadcasts whether it succeeded, which is also the
    barrier: no process returns before the file is durable, and if process 0 failed (a full disk, a missing
    directory) every process raises instead of one raising and the others waiting forever in a collective
    (a CheckpointWriteError everywhere if its disk was full, so every process can report it alike)."""
    remaining = iter(arrays)  # shared with the writer, so after a failure the rest can still be gathered
    failure = None
    if jax.process_index() == 0:
        try:
            with _atomic_file(path, size) as f:
                write_file(f, header, (_to_host(x) for x in remaining))
        except Exception as e:  # re-raised below, once the other processes have been told
            failure = e
    for x in remaining:  # other processes: all leaves; process 0: those after a failure
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            _to_host(x)  # take part in the gather (a collective), then drop the copy
    # 0: written; an errno: process 0's disk is full; -1: another failure.
    code = 0 if failure is None else failure.errno if isinstance(failure, fmt.CheckpointWriteError) else -1
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if failure is not None:
        raise failure
    if code > 0:
        kept = "the file there before is intact (process 0's error gives the space left)"
        raise fmt.CheckpointWriteError(path, code, needed=size, free=None, kept=kept)
    if code:
        raise RuntimeError(f"process 0 failed to write the checkpoint {path} (its own log has the error)")
    return path


@contextmanager
def _atomic_file(path: Path, size: int):
    """An open binary file that appears under `path`, fsynced, only when the `with` block succeeds; `size` is
    what it will hold, for the message when the disk is full (CheckpointWriteError)."""
    tmp, f = temp_path(path), None
    existed = path.exists()
    try:
        f = open(tmp, "xb", buffering=2**20)
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        if f is not None:
            with contextlib.suppress(OSError):  # a buffered write can fail again here; the file closes anyway
                f.close()
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            kept = "the file there before is intact" if existed else "no file was left behind"
            free = _free_bytes(path.parent)
            raise fmt.CheckpointWriteError(path, e.errno, needed=size, free=free, kept=kept) from None
        raise


def _free_bytes(directory: Path) -> int | None:
    """The bytes this user may still write on `directory`'s disk, or None if it cannot be asked."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside `path`: hidden, unique to this process, and ending in `TEMP_SUFFIX`."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")


def temp_owner(name: str) -> tuple[str, int] | None:
    """`(final name, pid of the writing process)` for a name `temp_path` made, else None."""
    match = _TEMP_NAME.fullmatch(name)
    return (match["name"], int(match["pid"])) if match else None


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
    return {
        "path": name,
        "dtype": dtype,
        "shape": [int(d) for d in x.shape],
        "nbytes": nbytes,
        "crc32": bytes(4 * fmt.n_records(nbytes, chunk_bytes)),
        "key_impl": key_impl,
    }


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


def _now() -> str:
    """The creation time stored in the header: ISO 8601, UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _step(step: Any) -> int:
    if np.ndim(step) != 0 or not np.issubdtype(np.asarray(step).dtype, np.integer):
        raise TypeError(f"step must be an integer scalar, got {tree_lib.describe(step)}")
    return int(step)
