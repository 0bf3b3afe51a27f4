"""`read_metadata` and `restore`: read a checkpoint file's header, then any part of its arrays, verified.

What `restore` does, in order: open the file (a regular file only: never a directory or a FIFO, which would
block for ever); read the preamble and the header, check the header's CRC-32 and every field against the
format and against the file's actual size, and rebuild the tree's shape from its node kinds (header.py,
nodes.py), before anything is allocated; check it against the template; then read the leaves -- by default
with the fast path (fast_read.py), with `threads=False` with the reference path (sequential.py), the same
checks either way -- and place each one as the template asks.

Memory: each leaf is read straight into its own freshly allocated, 64-byte-aligned buffer, which becomes the
returned array (on the CPU, `jax.device_put` adopts it without a copy), so restoring needs about 1.0x the data.

Any failure is a CheckpointError naming the file, the leaf and what was wrong: a damaged or crafted file, and
an I/O error while reading one. Nothing is unpickled and nothing from the file is imported or run.
"""

import contextlib
import functools
import os
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from purejax import tree as tree_lib
from purejax._untrusted import open_regular
from purejax.checkpoint import fast_read, sequential
from purejax.checkpoint import format as fmt
from purejax.checkpoint.format import CheckpointError, CheckpointInfo, LeafInfo
from purejax.checkpoint.header import parse_header

PyTree = Any


class Restored(NamedTuple):
    """What `restore` returns: the tree, and the file's `CheckpointInfo` (step, config, metadata, manifest)."""

    tree: PyTree
    info: CheckpointInfo


def read_metadata(path: str | os.PathLike) -> CheckpointInfo:
    """The step, config, metadata and manifest of the checkpoint at `path`, reading no array bytes.

    Also checks the header's CRC32, its tree, and that the file is exactly as long as the manifest says, so
    a truncated file is reported here (CheckpointError naming the first incomplete leaf)."""
    path = Path(path)
    with _open(path) as f:
        return _read_info(f, path)


def restore(
    path: str | os.PathLike,
    like: PyTree = None,
    *,
    subtree: str | None = None,
    cast: bool = False,
    threads: bool = True,
) -> Restored:
    """Read the checkpoint at `path`: `tree, info = restore(path, like=state)`.

    Arguments:
        path: a file written by `save`.
        like: a template: a tree of jax arrays, `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`), numpy
            arrays or Python scalars with the paths, shapes and dtypes expected. Every missing, unexpected,
            shape- or dtype-mismatched path is reported at once (TreeMismatchError). The result has the
            template's node types; jax leaves are placed with the template's shardings (each device gets
            only its slice), numpy leaves stay numpy, Python scalars come back as Python scalars.
            Without a template: the tree as saved, numpy arrays (typed PRNG keys as jax key arrays).
        subtree: a dotted path, e.g. "params": restore only that part, reading only its leaves' bytes.
            `like` then describes the subtree.
        cast: convert a leaf whose dtype differs from the template's to the template's dtype. Off by
            default, since a silent float32 -> bfloat16 (or int -> float) conversion loses information.
        threads: read with the fast path (16 threads reading at once); False: with the reference path,
            one thread front to back (sequential.py). The checks and the result are the same.

    Raises CheckpointError if the file is not a readable checkpoint (which file, which leaf, what), and
    FileNotFoundError if there is no file at `path`.
    """
    path = Path(path)
    if sys.byteorder != "little":
        raise NotImplementedError("purejax checkpoints are little-endian; this big-endian host cannot read them")
    read_leaves = fast_read.read_leaves if threads else sequential.read_leaves
    with _open(path) as f:
        info = _read_info(f, path)
        _check_keys(info)
        skeleton, index = info.tree, None
        if subtree:
            try:
                skeleton = tree_lib.subtree(skeleton, subtree)
            except KeyError as e:
                raise KeyError(f"checkpoint {path}: {e.args[0]}") from None
            index = tree_lib.flatten(skeleton)  # the paths within the subtree; distinct, as the manifest's are
        if like is None:
            wanted = range(len(info.leaves)) if index is None else index.values()
            arrays = {i: _untyped(array, info.leaves[i]) for i, array in read_leaves(f.fileno(), info, wanted)}
            return Restored(jax.tree_util.tree_map(lambda i: arrays[i], skeleton), info)
        if index is None:
            index = {leaf.path: i for i, leaf in enumerate(info.leaves)}
        like_flat = tree_lib.flatten(like)
        _check_like(path, subtree, {p: info.leaves[i] for p, i in index.items()}, like_flat, cast)
        # Each leaf is placed as soon as it is read, so an accelerator run holds one leaf on the host at a time.
        placed = {}
        for name, (i, array) in zip(sorted(index, key=index.get), read_leaves(f.fileno(), info, index.values())):
            placed[name] = _place(array, info.leaves[i], like_flat[name], cast)
        return Restored(tree_lib.unflatten_like(like, placed), info)


@contextlib.contextmanager
def _open(path: Path):
    """The file at `path`, open for reading, if it is a regular file (`_untrusted.open_regular`: a directory, a
    FIFO or a device is refused before it is opened). An OSError while it is open (EIO from a failing disk)
    becomes a CheckpointError; a missing file stays FileNotFoundError."""
    with open_regular(path, functools.partial(CheckpointError, path)) as f:
        try:
            yield f
        except OSError as e:
            raise CheckpointError(path, f"cannot be read: {e}") from None


def _read_info(f, path: Path) -> CheckpointInfo:
    header_nbytes, header_crc = fmt.unpack_preamble(_read_upto(f, fmt.PREAMBLE_SIZE), path)
    raw = _read_upto(f, header_nbytes)
    if len(raw) < header_nbytes:
        raise CheckpointError(path, f"file is truncated inside the header ({len(raw)} of {header_nbytes} bytes)")
    if (computed := zlib.crc32(raw)) != header_crc:
        problem = f"the header fails its CRC32 check (stored {header_crc:#010x}, computed {computed:#010x})"
        raise CheckpointError(path, f"{problem}: the file is corrupt")
    size = os.fstat(f.fileno()).st_size
    info = parse_header(raw, path, fmt.PREAMBLE_SIZE + header_nbytes, size)  # truncation: a CheckpointError
    if size > info.size:
        raise CheckpointError(path, f"file has {size - info.size:,} bytes after its last record: it is corrupt")
    return info


def _check_keys(info: CheckpointInfo) -> None:
    """CheckpointError unless each typed key's implementation is one jax knows and its key data fits it."""
    for leaf in info.leaves:
        if leaf.key_impl is None:
            continue
        try:
            _, data = _key_layout(leaf.key_impl)
        except Exception as e:  # jax raises ValueError or KeyError for an unknown implementation
            problem = f"unknown PRNG key implementation {leaf.key_impl!r} ({e})"
            raise CheckpointError(info.path, problem, leaf=leaf.path) from None
        if leaf.dtype != data.dtype.name or leaf.shape[len(leaf.shape) - len(data.shape) :] != data.shape:
            each = f"{data.dtype.name}{list(data.shape)} each"
            problem = f"key data {leaf.dtype}{list(leaf.shape)} does not fit {leaf.key_impl} keys ({each})"
            raise CheckpointError(info.path, problem, leaf=leaf.path)


@functools.cache
def _key_layout(impl: str) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The abstract key and key data of one `impl` key, e.g. `(key<fry>[], uint32[2])` for threefry2x32."""
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    return key, jax.eval_shape(jax.random.key_data, key)


def _check_like(path: Path, subtree: str | None, stored: dict[str, LeafInfo], like: dict[str, Any], cast: bool) -> None:
    """TreeMismatchError listing every difference between the stored leaves and the template."""
    for name, x in like.items():
        if isinstance(x, jax.ShapeDtypeStruct) and not _is_key(x) and jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
            raise ValueError(
                f"template leaf {name!r} is {np.dtype(x.dtype).name}, which jax holds only with jax_enable_x64: "
                "enable it, or restore into a template of the 32-bit dtype with cast=True"
            )
    got = {p: _abstract(leaf) for p, leaf in stored.items()}
    report = tree_lib.diff(got, {p: _abstract_like(x, p) for p, x in like.items()})
    if cast:  # dtypes may differ, except that a key never converts to or from a number
        report.dtype = [d for d in report.dtype if (d[1].startswith("key<") or d[2].startswith("key<"))]
    if report.ok:
        return
    what = f"checkpoint {path}" + (f" (subtree {subtree!r})" if subtree else "")
    lines = [report.format(what), "  (missing: in `like`, not in the file; unexpected: in the file, not in `like`)"]
    if report.dtype and not cast:
        lines.append("  to convert dtypes, pass cast=True")
    raise tree_lib.TreeMismatchError("\n".join(lines))


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _abstract(leaf: LeafInfo) -> jax.ShapeDtypeStruct:
    """The shape and dtype a stored leaf restores to (a typed key's, not its key data's)."""
    if leaf.key_impl is None:
        return jax.ShapeDtypeStruct(leaf.shape, fmt.DTYPES[leaf.dtype])
    key, data = _key_layout(leaf.key_impl)
    return jax.ShapeDtypeStruct(leaf.shape[: len(leaf.shape) - len(data.shape)], key.dtype)


def _abstract_like(x: Any, name: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(x, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), np.asarray(x).dtype)
    raise TypeError(f"template leaf {name!r} is a {type(x).__name__}; use arrays, jax.ShapeDtypeStruct or scalars")


def _untyped(array: np.ndarray, leaf: LeafInfo) -> Any:
    """A leaf restored without a template: the numpy array, or a jax key array for a typed key."""
    return array if leaf.key_impl is None else jax.random.wrap_key_data(array, impl=leaf.key_impl)


def _place(array: np.ndarray, leaf: LeafInfo, like: Any, cast: bool) -> Any:
    """`array` as the template leaf `like` wants it: on its devices with its sharding, or numpy, or a scalar."""
    if leaf.key_impl is not None:
        sharding = getattr(like, "sharding", None)
        if sharding is None:
            return _untyped(array, leaf)
        # An index of the key array selects the same keys' data (the trailing key-data axes stay whole).
        wrap = lambda index: jax.random.wrap_key_data(array[index], impl=leaf.key_impl)  # noqa: E731
        return jax.make_array_from_callback(_abstract(leaf).shape, sharding, wrap)
    dtype = np.dtype(like.dtype) if hasattr(like, "dtype") else np.asarray(like).dtype
    if cast and array.dtype != dtype:
        array = array.astype(dtype)
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = like.sharding
        if sharding is None:
            return jax.device_put(array)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
    if isinstance(like, np.ndarray):
        return array
    if isinstance(like, np.generic):
        return array[()]
    return type(like)(array.item())


def _read_upto(f, n: int) -> bytes:
    """Up to `n` bytes; fewer only at the end of the file."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)
