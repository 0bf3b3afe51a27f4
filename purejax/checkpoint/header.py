"""The header: the map after the preamble that says what every byte after it is, built by `save` and checked
by every reader before it allocates anything.

    {"purejax_version": ..., "created": ..., "step": ..., "config": ..., "metadata": {...},
     "byte_order": "little", "chunk_bytes": ..., "tree": {node kinds, see nodes.py},
     "leaves": [{"path": "params.w", "dtype": "float32", "shape": [768, 3072], "nbytes": ...,
                 "crc32": <4 bytes per record>, "key_impl": None}, ...]}

A reader trusts nothing in it that it has not checked: `parse_header` bounds every size by fixed limits
(`MAX_NDIM` dimensions, no array larger than numpy can index) before it multiplies anything out, and by the
bytes the file actually holds before it builds anything per record. So a crafted header of a few hundred
bytes costs a reader neither time nor memory: it is a CheckpointError naming the file and the leaf.
"""

import dataclasses
import functools
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import msgpack
import numpy as np

from purejax.checkpoint import format as fmt
from purejax.checkpoint.format import CheckpointError, CheckpointInfo, LeafInfo

_NUMPY_LIMIT = 2**63  # numpy indexes an array's bytes with int64: the non-zero dimensions' bytes must fit


def header_dict(
    *, purejax_version: str, created: str, step: int | None, config: Any, metadata: dict[str, Any],
    chunk_bytes: int, tree: dict[str, Any], leaves: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
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


def parse_header(header: Any, path: Path, data_offset: int, file_size: int) -> CheckpointInfo:
    """Check a decoded header map against the format and against the `file_size` bytes the file has, and
    compute each leaf's offset (the first leaf's is `data_offset`); CheckpointError naming what is wrong."""
    fail = functools.partial(_invalid, path)
    if not isinstance(header, dict):
        fail(f"expected a map, got {type(header).__name__}")
    for key, kinds in [("purejax_version", str), ("created", str), ("step", (int, type(None))), ("metadata", dict),
                       ("byte_order", str), ("chunk_bytes", int), ("tree", dict), ("leaves", list)]:  # fmt: skip
        if not isinstance(header.get(key), kinds) or isinstance(header.get(key), bool):
            fail(f"field {key!r} is missing or has the wrong type ({type(header.get(key)).__name__})")
    if not all(type(k) in (str, int) for k in header["metadata"]):
        fail(f"metadata has a key that is neither str nor int: {_short(list(header['metadata']))}")
    if not all(type(k) is str for k in header["tree"]):
        fail(f"the tree's root node has a key that is not a string: {_short(list(header['tree']))}")
    if header["byte_order"] != fmt.BYTE_ORDER:
        fail(f"byte_order is {header['byte_order']!r}; version {fmt.VERSION} files are {fmt.BYTE_ORDER!r}")
    chunk_bytes = header["chunk_bytes"]
    if not 0 < chunk_bytes <= fmt.MAX_CHUNK_BYTES:
        fail(f"chunk_bytes {chunk_bytes} is outside 1..{fmt.MAX_CHUNK_BYTES}")
    leaves, offset = [], data_offset
    for i, entry in enumerate(header["leaves"]):
        leaf = _parse_leaf(entry, i, chunk_bytes, offset, file_size, path)
        leaves.append(leaf)
        offset += leaf.size_in_file
    return CheckpointInfo(
        path=path, version=fmt.VERSION, purejax_version=header["purejax_version"], created=header["created"],
        step=header.get("step"), config=header.get("config"), metadata=header["metadata"], chunk_bytes=chunk_bytes,
        tree=header["tree"], leaves=tuple(leaves), size=offset,
    )  # fmt: skip


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
        fail(f"unknown dtype {_short(dtype)}", name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        fail(f"shape {_short(shape)} is not a list of non-negative integers", name)
    if len(shape) > fmt.MAX_NDIM:
        fail(f"shape has {len(shape):,} dimensions; at most {fmt.MAX_NDIM}", name)
    extent = fmt.DTYPES[dtype].itemsize  # the non-zero dimensions' bytes: numpy needs them below 2**63
    for d in shape:
        extent *= max(d, 1)
        if extent >= _NUMPY_LIMIT:
            fail(f"{dtype}{_short(shape)} is larger than any array can be (2**63 bytes)", name)
    expected = 0 if 0 in shape else extent
    if type(nbytes) is not int or nbytes != expected:  # not 24.0, not True
        fail(f"nbytes {_short(nbytes)} does not equal {dtype}{_short(shape)}'s {expected}", name)
    n = fmt.n_records(nbytes, chunk_bytes)
    if (end := offset + nbytes + fmt.RECORD_PREFIX_SIZE * n) > file_size:
        problem = f"file is truncated: it has {file_size:,} bytes, and this leaf's records end at byte {end:,}"
        raise CheckpointError(path, problem, leaf=name)
    if not isinstance(crc, bytes) or len(crc) != 4 * n:
        fail(f"crc32 must be {4 * n:,} bytes (4 per record), got {type(crc).__name__}", name)
    if impl is not None and not isinstance(impl, str):
        fail(f"key_impl {_short(impl)} is not a string", name)
    crcs = tuple(int(c) for c in np.frombuffer(crc, "<u4"))
    return LeafInfo(name, dtype, tuple(shape), nbytes, crcs, impl, offset)


def _invalid(path: Path, problem: str, leaf: str | None = None) -> NoReturn:
    raise CheckpointError(path, f"invalid header: {problem}", leaf=leaf)


def _short(value: Any) -> str:
    """`repr(value)`, cut to 60 characters: a message quotes what it refuses, not all of it."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


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
