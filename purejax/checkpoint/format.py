"""The checkpoint file layout, byte for byte: preamble, header schema, dtype names, and the error readers raise.

A checkpoint is a sequence of msgpack objects (docs/checkpoint-format.md is the full specification):

    preamble   31 bytes   array [FORMAT_NAME, VERSION, header length, header CRC32], fixed-width encoding
    header     n bytes    map: step, config, metadata, the tree's node kinds and the manifest of leaves
    records    ...        one bin 32 per chunk of each leaf, leaves in manifest order, chunks in order

The preamble has a fixed size so a reader can check the header's length against `MAX_HEADER_BYTES` before
reading it: a hostile or corrupt file cannot make a reader allocate unbounded memory. Every record is a
bin 32 even when it is short, so each leaf's file offset follows from the manifest alone, which is what lets
a partial restore seek straight to the leaves it wants.
"""

import dataclasses
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

FORMAT_NAME = "purejax.checkpoint"
VERSION = 1
BYTE_ORDER = "little"

# 0x94: array of 4; 0xb2: str of 18 bytes; VERSION as a positive fixint; 0xce: uint 32 (big-endian), twice.
_PREAMBLE = struct.Struct(">BB18sBBIBI")
PREAMBLE_SIZE = _PREAMBLE.size  # 31
MAGIC = bytes([0x94, 0xB2]) + FORMAT_NAME.encode()  # the first 20 bytes of every version's file

# 0xc6: bin 32, then the payload length as uint 32 (big-endian).
_RECORD_PREFIX = struct.Struct(">BI")
RECORD_PREFIX_SIZE = _RECORD_PREFIX.size  # 5

MAX_HEADER_BYTES = 64 * 2**20  # ~400k leaves of manifest; a larger header is refused before it is read
DEFAULT_CHUNK_BYTES = 256 * 2**20
# msgpack-python's streaming Unpacker holds at most 2 GiB - 1 in its buffer (its `max_buffer_size=0`), so
# every record must stay below that for a stock reader; 1 GiB leaves a wide margin.
MAX_CHUNK_BYTES = 2**30

# Every dtype jax can hold, by numpy name. The sub-byte types (int1, int2, int4, their unsigned versions,
# float4_e2m1fn and the float6 types) are stored as ml_dtypes holds them in memory: one element per byte, the
# value in the low bits, the high bits 0.
_DTYPE_NAMES = (
    "bool",
    *(f"{s}int{b}" for s in ("", "u") for b in (1, 2, 4, 8, 16, 32, 64)),
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name, name))
    for name in _DTYPE_NAMES
    if hasattr(ml_dtypes, name) or hasattr(np, name)  # a newer name than this ml_dtypes knows is left out
}


class CheckpointError(Exception):
    """A checkpoint file cannot be read: not a checkpoint, an unsupported version, truncated or corrupt.

    `path` is the file; `leaf` the dotted path of the damaged leaf, or None when the damage is in the
    preamble or the header; `problem` says what is wrong.
    """

    def __init__(self, path: Any, problem: str, *, leaf: str | None = None):
        self.path, self.problem, self.leaf = path, problem, leaf
        where = f"{path}" if leaf is None else f"{path}, leaf {leaf!r}"
        super().__init__(f"checkpoint {where}: {problem}")


def dtype_name(dtype: Any) -> str:
    """The name a dtype is stored under, e.g. "bfloat16"; TypeError for a dtype a checkpoint cannot hold."""
    name = np.dtype(dtype).name  # the same for either byte order; `save` writes little-endian bytes
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {', '.join(DTYPES)}")
    return name


def chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """The payload lengths of a leaf's records: full chunks, then the remainder; none for an empty leaf."""
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def pack_preamble(header_nbytes: int, header_crc32: int) -> bytes:
    return _PREAMBLE.pack(0x94, 0xB2, FORMAT_NAME.encode(), VERSION, 0xCE, header_nbytes, 0xCE, header_crc32)


def unpack_preamble(raw: bytes, path: Any) -> tuple[int, int]:
    """`(header length, header CRC32)` from the first `PREAMBLE_SIZE` bytes of a file, or CheckpointError."""
    if len(raw) < PREAMBLE_SIZE and MAGIC.startswith(raw[: len(MAGIC)]):
        problem = f"file is truncated: {len(raw)} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble"
        raise CheckpointError(path, problem)
    if not raw.startswith(MAGIC):
        problem = f"not a purejax checkpoint: it does not start with the msgpack string {FORMAT_NAME!r}"
        raise CheckpointError(path, problem)
    _, _, _, version, tag_len, header_nbytes, tag_crc, header_crc = _PREAMBLE.unpack(raw)
    if version != VERSION:
        raise CheckpointError(path, f"format version {version}; this purejax reads version {VERSION} (upgrade purejax)")
    if (tag_len, tag_crc) != (0xCE, 0xCE):
        raise CheckpointError(path, "the preamble is corrupt: header length and CRC must be msgpack uint 32 (0xce)")
    if header_nbytes > MAX_HEADER_BYTES:
        raise CheckpointError(path, f"header claims {header_nbytes:,} bytes, over the {MAX_HEADER_BYTES:,}-byte limit")
    return header_nbytes, header_crc


def pack_record_prefix(nbytes: int) -> bytes:
    return _RECORD_PREFIX.pack(0xC6, nbytes)


def unpack_record_prefix(raw: bytes) -> int | None:
    """The payload length of a record prefix, or None if `raw` is not a bin 32 prefix."""
    if len(raw) != RECORD_PREFIX_SIZE or raw[0] != 0xC6:
        return None
    return _RECORD_PREFIX.unpack(raw)[1]


@dataclass(frozen=True)
class LeafInfo:
    """One manifest entry: a leaf's dotted path, what its bytes are, and where they are in the file.

    For a typed PRNG key, `dtype` and `shape` describe its key data (`jax.random.key_data`) and `key_impl`
    names the implementation (e.g. "threefry2x32"); otherwise `key_impl` is None.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: tuple[int, ...]  # one per chunk
    key_impl: str | None
    offset: int  # file offset of the leaf's first record

    @property
    def size_in_file(self) -> int:
        return self.nbytes + RECORD_PREFIX_SIZE * len(self.crc32)


@dataclass(frozen=True)
class CheckpointInfo:
    """Everything in a checkpoint except the array bytes: what `read_metadata` returns."""

    path: Path
    version: int
    purejax_version: str
    created: str  # ISO 8601, UTC
    step: int | None
    config: Any
    metadata: dict[str, Any]
    chunk_bytes: int
    tree: dict[str, Any]  # the node kinds, see purejax/checkpoint/nodes.py
    leaves: tuple[LeafInfo, ...]  # in file order
    size: int  # the file's length in bytes

    @property
    def manifest(self) -> dict[str, LeafInfo]:
        return {leaf.path: leaf for leaf in self.leaves}


def header_dict(
    *, purejax_version: str, created: str, step: int | None, config: Any, metadata: dict[str, Any],
    chunk_bytes: int, tree: dict[str, Any], leaves: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The header map in the key order the specification lists. Each entry of `leaves` is a map with
    "path", "dtype", "shape", "nbytes", "crc32" (4 bytes per chunk, little-endian uint32) and "key_impl"."""
    return {
        "purejax_version": purejax_version,
        "created": created,
        "step": step,
        "config": config,
        "metadata": metadata,
        "byte_order": BYTE_ORDER,
        "chunk_bytes": chunk_bytes,
        "tree": tree,
        "leaves": leaves,
    }


def parse_header(header: Any, path: Path, data_offset: int) -> CheckpointInfo:
    """Validate a decoded header map and compute each leaf's offset; CheckpointError naming what is wrong.

    A reader trusts nothing it has not checked here: every length is recomputed from dtype and shape, so a
    corrupt header cannot make it allocate more than the file holds (the file's size is checked against
    `CheckpointInfo.size` before any array is allocated)."""

    def fail(problem: str, leaf: str | None = None):
        raise CheckpointError(path, f"invalid header: {problem}", leaf=leaf)

    if not isinstance(header, dict):
        fail(f"expected a map, got {type(header).__name__}")
    for key, kinds in [("purejax_version", str), ("created", str), ("step", (int, type(None))), ("metadata", dict),
                       ("byte_order", str), ("chunk_bytes", int), ("tree", dict), ("leaves", list)]:  # fmt: skip
        if not isinstance(header.get(key), kinds) or isinstance(header.get(key), bool):
            fail(f"field {key!r} is missing or has the wrong type ({type(header.get(key)).__name__})")
    if header["byte_order"] != BYTE_ORDER:
        fail(f"byte_order is {header['byte_order']!r}; version {VERSION} files are {BYTE_ORDER!r}")
    chunk_bytes = header["chunk_bytes"]
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        fail(f"chunk_bytes {chunk_bytes} is outside 1..{MAX_CHUNK_BYTES}")
    leaves, offset = [], data_offset
    for i, entry in enumerate(header["leaves"]):
        leaf = _parse_leaf(entry, i, chunk_bytes, offset, fail)
        leaves.append(leaf)
        offset += leaf.size_in_file
    return CheckpointInfo(
        path=path, version=VERSION, purejax_version=header["purejax_version"], created=header["created"],
        step=header["step"], config=header.get("config"), metadata=header["metadata"], chunk_bytes=chunk_bytes,
        tree=header["tree"], leaves=tuple(leaves), size=offset,
    )  # fmt: skip


def _parse_leaf(entry: Any, i: int, chunk_bytes: int, offset: int, fail) -> LeafInfo:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        fail(f"manifest entry {i} is not a map with a string 'path'")
    name = entry["path"]
    dtype, shape, nbytes, crc, impl = (entry.get(k) for k in ("dtype", "shape", "nbytes", "crc32", "key_impl"))
    if dtype not in DTYPES:
        fail(f"unknown dtype {dtype!r}", name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        fail(f"shape {shape!r} is not a list of non-negative integers", name)
    if type(nbytes) is not int or nbytes != math.prod(shape) * DTYPES[dtype].itemsize:  # not 24.0, not True
        fail(f"nbytes {nbytes!r} does not equal {dtype}{shape}'s {math.prod(shape) * DTYPES[dtype].itemsize}", name)
    n_chunks = len(chunk_sizes(nbytes, chunk_bytes))
    if not isinstance(crc, bytes) or len(crc) != 4 * n_chunks:
        fail(f"crc32 must be {4 * n_chunks} bytes (4 per chunk), got {type(crc).__name__}", name)
    if impl is not None and not isinstance(impl, str):
        fail(f"key_impl {impl!r} is not a string", name)
    crcs = tuple(int(c) for c in np.frombuffer(crc, "<u4"))
    return LeafInfo(name, dtype, tuple(shape), nbytes, crcs, impl, offset)


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
