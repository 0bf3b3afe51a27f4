"""The header: the map after the preamble that says what every byte after it is, built by `save` and checked
by every reader before it allocates anything.

    {"purejax_version": ..., "created": ..., "step": ..., "config": ..., "metadata": {...},
     "byte_order": "little", "chunk_bytes": ..., "tree": {node kinds, see nodes.py},
     "leaves": [{"path": "params.w", "dtype": "float32", "shape": [768, 3072], "nbytes": ...,
                 "crc32": <4 bytes per record>, "key_impl": None}, ...]}

A reader trusts nothing in it that it has not checked: `parse_header` bounds every size by fixed limits
(`MAX_NDIM` dimensions, no array larger than numpy can index) before it multiplies anything out, and by the
bytes the file actually holds before it builds anything per record. So a crafted header of a few hundred
bytes costs a reader neither time nor memory: it is a CheckpointError naming the file and the leaf. And it
reads the header a value at a time against a budget of a fixed multiple of its size (stream.py), so neither
can a large one, whatever it holds.
"""

import dataclasses
import functools
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import msgpack
import numpy as np

from purejax._untrusted import short
from purejax.checkpoint import format as fmt
from purejax.checkpoint import nodes
from purejax.checkpoint.format import CheckpointError, CheckpointInfo, LeafInfo
from purejax.checkpoint.stream import Budget, OverBudget, Stream

_NUMPY_LIMIT = 2**63  # numpy indexes an array's bytes with int64: the non-zero dimensions' bytes must fit
_DTYPE_NAMES = {name: name for name in fmt.DTYPES}
# A LeafInfo's memory but its path's characters, shape's and checksums' elements: its slots, the path, shape and
# checksum objects, the offset, its places in the lists and the set that hold it while the header is read.
_LEAF_BYTES = 400


def header_dict(
    *,
    purejax_version: str,
    created: str,
    step: int | None,
    config: Any,
    metadata: dict[str, Any],
    chunk_bytes: int,
    tree: dict[str, Any],
    leaves: list[dict[str, Any]],
) -> dict[str, Any]:
    """The header map in the key order the specification lists. Each entry of `leaves` is a map with
    "path", "dtype", "shape", "nbytes", "crc32" (4 bytes per record, little-endian uint32) and "key_impl"."""
    return {
        "purejax_version": purejax_version,
        "created": created,
        "step": step,
        "config": config,
        "metadata": metadata,
        "byte_order": fmt.BYTE_ORDER,
        "chunk_bytes": chunk_bytes,
        "tree": tree,
        "leaves": leaves,
    }


def encode_header(header: dict[str, Any]) -> bytes:
    """What a file starts with: the preamble (with the header's length and CRC-32), then the header."""
    raw = msgpack.packb(header, use_bin_type=True)
    return fmt.pack_preamble(len(raw), zlib.crc32(raw)) + raw


def parse_header(raw: bytes, path: Path, data_offset: int, file_size: int) -> CheckpointInfo:
    """Read the header `raw` (its CRC already checked) a value at a time, check it against the format and against
    the `file_size` bytes the file has, compute each leaf's offset (the first leaf's is `data_offset`) and
    rebuild the tree (nodes.py); CheckpointError naming what is wrong.

    What it builds is charged to a `stream.Budget` of a fixed multiple of the header's size: the top-level
    fields first (the tree and the manifest passed over), then the manifest, one entry at a time, each entry
    replaced by its `LeafInfo` before the next is read, then the tree, whose leaves are checked against the
    manifest's paths as they are met."""
    budget = Budget(len(raw))
    try:
        header, offsets = _top_level(Stream(raw, budget), path)
        manifest = Stream(raw, budget, offsets["leaves"], bound=True)
        leaves = _read_manifest(manifest, header["chunk_bytes"], data_offset, file_size, path)
        tree = _read_tree(Stream(raw, budget, offsets["tree"]), leaves, path)
    except CheckpointError:
        raise
    except OverBudget as e:
        raise CheckpointError(path, str(e)) from None
    except Exception as e:  # msgpack raises several types for malformed data (and TypeError for a list key)
        raise CheckpointError(path, f"the header is not valid msgpack: {type(e).__name__}: {e}") from None
    size = leaves[-1].offset + leaves[-1].size_in_file if leaves else data_offset
    return CheckpointInfo(
        path=path,
        version=fmt.VERSION,
        purejax_version=header["purejax_version"],
        created=header["created"],
        step=header.get("step"),
        config=header.get("config"),
        metadata=header["metadata"],
        chunk_bytes=header["chunk_bytes"],
        tree=tree,
        leaves=leaves,
        size=size,
    )


_FIELD_TYPES = {
    "purejax_version": str,
    "created": str,
    "step": (int, type(None)),
    "metadata": dict,
    "byte_order": str,
    "chunk_bytes": int,
}  # and "config", of any type


def _top_level(stream: Stream, path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The header's fields but the tree and the manifest, checked, and the offsets of those two in the header.

    First the whole header is passed over (msgpack's `skip`, which builds nothing), so every array and map it
    claims is known to be there before any is built: msgpack allocates an array's slots when it reads the
    array's length, and a crafted header of nested claims ("a million elements" a thousand times over, in
    a few kilobytes) would otherwise allocate without bound."""
    fail = functools.partial(_invalid, path)
    whole = stream.at(0)
    whole.skip()
    if whole.offset != len(stream.raw):
        fail(f"{len(stream.raw) - whole.offset:,} bytes follow the header's map")
    n = stream.map_header()
    if n is None:
        fail("expected a map")
    header, offsets = {}, {}
    for _ in range(n):  # keys in any order; unknown ones (a later revision's) are passed over unread
        key = stream.value()
        if type(key) is str and key in ("tree", "leaves"):
            offsets[key] = stream.offset
            stream.skip()
        elif type(key) is str and (key in _FIELD_TYPES or key == "config"):
            header[key] = stream.budget.keep(stream.value())
        else:
            stream.skip()
    for key, kinds in _FIELD_TYPES.items():
        if not isinstance(header.get(key), kinds) or isinstance(header.get(key), bool):
            fail(f"field {key!r} is missing or has the wrong type ({type(header.get(key)).__name__})")
    for key in ("tree", "leaves"):
        if key not in offsets:
            fail(f"field {key!r} is missing")
    if not all(type(k) in (str, int) for k in header["metadata"]):
        fail(f"metadata has a key that is neither str nor int: {short(list(header['metadata']))}")
    if header["byte_order"] != fmt.BYTE_ORDER:
        fail(f"byte_order is {header['byte_order']!r}; version {fmt.VERSION} files are {fmt.BYTE_ORDER!r}")
    if not 0 < header["chunk_bytes"] <= fmt.MAX_CHUNK_BYTES:
        fail(f"chunk_bytes {header['chunk_bytes']} is outside 1..{fmt.MAX_CHUNK_BYTES}")
    return header, offsets


def _read_manifest(stream: Stream, chunk_bytes: int, offset: int, file_size: int, path: Path) -> tuple[LeafInfo, ...]:
    """The manifest's entries, each read, checked and turned into a `LeafInfo` before the next is read."""
    n = stream.array_header()
    if n is None:
        _invalid(path, "field 'leaves' is missing or has the wrong type (not an array)")
    leaves, seen, budget = [], set(), stream.budget
    for i in range(n):
        before = budget.used
        entry = stream.value()
        budget.used = before  # the entry is dropped once its LeafInfo is made; the LeafInfo is charged instead
        leaf = _parse_leaf(entry, i, chunk_bytes, offset, file_size, path)
        if leaf.path in seen:
            _invalid(path, "two manifest entries have this path", leaf.path)
        seen.add(leaf.path)
        budget.charge(_LEAF_BYTES + len(leaf.path) + 8 * len(leaf.shape) + 4 * len(leaf.crc32))
        leaves.append(leaf)
        offset += leaf.size_in_file
    return tuple(leaves)


def _read_tree(stream: Stream, leaves: tuple[LeafInfo, ...], path: Path) -> Any:
    """The tree (nodes.read), each leaf checked against its manifest entry's path."""
    try:
        return nodes.read(stream, len(leaves), [leaf.path for leaf in leaves])
    except OverBudget:
        raise
    except ValueError as e:  # msgpack's errors for malformed bytes in the tree are ValueErrors too
        raise CheckpointError(path, f"invalid tree in header: {e}") from None


def _parse_leaf(entry: Any, i: int, chunk_bytes: int, offset: int, file_size: int, path: Path) -> LeafInfo:
    """One manifest entry, checked in an order that keeps every step cheap: types, then the fixed limits on
    the shape, then the size it implies, then that size (and its records' framing) against the bytes the
    file has, and only then anything per record."""
    fail = functools.partial(_invalid, path)
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        fail(f"manifest entry {i} is not a map with a string 'path'")
    name = entry["path"]
    dtype, shape, nbytes, crc, impl = (entry.get(k) for k in ("dtype", "shape", "nbytes", "crc32", "key_impl"))
    if not isinstance(dtype, str) or dtype not in fmt.DTYPES:
        fail(f"unknown dtype {short(dtype)}", name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        fail(f"shape {short(shape)} is not a list of non-negative integers", name)
    if len(shape) > fmt.MAX_NDIM:
        fail(f"shape has {len(shape):,} dimensions; at most {fmt.MAX_NDIM}", name)
    extent = fmt.DTYPES[dtype].itemsize  # the non-zero dimensions' bytes: numpy needs them below 2**63
    for d in shape:
        extent *= max(d, 1)
        if extent >= _NUMPY_LIMIT:
            fail(f"{dtype}{short(shape)} is larger than any array can be (2**63 bytes)", name)
    expected = 0 if 0 in shape else extent
    if type(nbytes) is not int or nbytes != expected:  # not 24.0, not True
        fail(f"nbytes {short(nbytes)} does not equal {dtype}{short(shape)}'s {expected}", name)
    n = fmt.n_records(nbytes, chunk_bytes)
    if (end := offset + nbytes + fmt.RECORD_PREFIX_SIZE * n) > file_size:
        problem = f"file is truncated: it has {file_size:,} bytes, and this leaf's records end at byte {end:,}"
        raise CheckpointError(path, problem, leaf=name)
    if not isinstance(crc, bytes) or len(crc) != 4 * n:
        fail(f"crc32 must be {4 * n:,} bytes (4 per record), got {type(crc).__name__}", name)
    if impl is not None and not isinstance(impl, str):
        fail(f"key_impl {short(impl)} is not a string", name)
    dtype = _DTYPE_NAMES[dtype]  # one str object for every leaf of a dtype, not one each
    return LeafInfo(name, dtype, tuple(shape), nbytes, fmt.crc32_array(crc), impl, offset)


def _invalid(path: Path, problem: str, leaf: str | None = None) -> NoReturn:
    raise CheckpointError(path, f"invalid header: {problem}", leaf=leaf)


def plain(value: Any, where: str) -> Any:
    """`value` as plain msgpack data for the header's config and metadata: None, bool, int, float, str,
    bytes, lists and str- or int-keyed maps. Tuples become lists, dataclasses maps of their fields, numpy
    scalars Python numbers, dtypes their names; anything else is a TypeError naming `where` it is."""
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise TypeError(f"{where} = {value} does not fit in 64 bits; store it as a string")
        return value
    if isinstance(value, np.generic) or (hasattr(value, "item") and getattr(value, "shape", None) == ()):
        return plain(value.item(), where)  # numpy scalars, 0-d numpy and jax arrays: float(loss) for you
    if isinstance(value, np.dtype) or (isinstance(value, type) and hasattr(value, "dtype")):
        return np.dtype(value).name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, (str, int)) or isinstance(k, bool)]
        if bad:
            raise TypeError(f"{where} has the key {bad[0]!r}; header maps take str or int keys")
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}.{i}") for i, v in enumerate(value)]
    raise TypeError(
        f"{where} is a {type(value).__name__}, which a checkpoint header cannot hold: use None, bool, int, "
        "float, str, bytes, lists and dicts (or a dataclass of them); put arrays in the tree instead"
    )
