"""The checkpoint file layout, byte for byte: preamble, header schema, dtype names, and the error readers raise.

A checkpoint is a sequence of msgpack objects (docs/checkpoint-format.md is the full specification):

    preamble   31 bytes   array [FORMAT_NAME, VERSION, header length, header CRC32], fixed-width encoding
    header     n bytes    map: step, config, metadata, the tree's node kinds and the manifest of leaves
    records    ...        one bin 32 per chunk of each leaf, leaves in manifest order, chunks in order

The preamble has a fixed size so a reader can check the header's length against `MAX_HEADER_BYTES` before
reading it: a hostile or corrupt file cannot make a reader allocate unbounded memory. Every record is a
bin 32 even when it is short, so each leaf's file offset follows from the manifest alone, which is what lets
a partial restore seek straight to the leaves it wants. The header map itself is built and checked in
header.py; the node kinds of the tree are in nodes.py.
"""

import array
import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
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
# Fixed limits a reader checks before it allocates or multiplies anything a file claims. MAX_NDIM is numpy's
# own (2.x); MAX_DEPTH, nested containers in a tree, keeps every recursive walk of a tree (here, in jax and in
# msgpack, whose encoder stops at 511 levels, two per tree level) far from Python's recursion limit.
MAX_NDIM = 64
MAX_DEPTH = 100

# Every dtype jax can hold, by numpy name. The sub-byte types (int1, int2, int4, their unsigned versions,
# float4_e2m1fn and the float6 types) are stored as ml_dtypes holds them in memory: one element per byte, the
# value in the low bits, the high bits 0.
_DTYPE_NAMES = (
    "bool",
    *(f"{s}int{b}" for s in ("", "u") for b in (1, 2, 4, 8, 16, 32, 64)),
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name, name))
    for name in _DTYPE_NAMES
    if hasattr(ml_dtypes, name) or hasattr(np, name)  # a newer name than this ml_dtypes knows is left out
}
# The dtypes that use only the low bits of their byte: a reader refuses a byte with any higher bit set (a bool
# of 2, an int4 of 0xf7), which numpy and ml_dtypes would otherwise read as some value or other.
_VALUE_BITS = {
    "bool": 1,
    "int1": 1,
    "uint1": 1,
    "int2": 2,
    "uint2": 2,
    "int4": 4,
    "uint4": 4,
    "float4_e2m1fn": 4,
    "float6_e2m3fn": 6,
    "float6_e3m2fn": 6,
}
VALUE_BITS: dict[str, int] = {name: bits for name, bits in _VALUE_BITS.items() if name in DTYPES}


class CheckpointError(Exception):
    """A checkpoint file cannot be read: not a checkpoint, an unsupported version, truncated or corrupt, not
    a regular file, or unreadable (no permission, an I/O error); or a `CheckpointManager` has no such step.

    `path` is the file; `leaf` the dotted path of the damaged leaf, or None when the damage is in the
    preamble or the header; `problem` says what is wrong.
    """

    def __init__(self, path: Any, problem: str, *, leaf: str | None = None):
        self.path, self.problem, self.leaf = path, problem, leaf
        where = f"{path}" if leaf is None else f"{path}, leaf {leaf!r}"
        super().__init__(f"checkpoint {where}: {problem}")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: its disk is full or over quota (`errno` ENOSPC or EDQUOT; an
    OSError, so `except OSError` still catches it). The file it was to replace, if any, is intact, and its
    temporary file is removed.

    `path` is the checkpoint; `needed` the bytes its file takes; `free` the bytes its directory's disk has
    left for this user once the temporary file is gone (None where unknown); `last_good` the newest
    checkpoint still readable, named by `CheckpointManager.save` (None from `save`, or where there is none);
    `kept` says in words what is left on disk. `str()` is the whole message, one line.
    """

    def __init__(self, path: Any, code: int, *, needed: int, free: int | None, kept: str, last_good: Any = None):
        super().__init__(code, os.strerror(code), str(path))
        self.path, self.needed, self.free, self.kept, self.last_good = path, needed, free, kept, last_good

    def __str__(self) -> str:
        full = "the disk is full" if self.errno == errno.ENOSPC else "the disk quota is exceeded"
        left = "" if self.free is None else f", {self.free:,} are free"
        return f"cannot write checkpoint {self.path}: {full}: it needs {self.needed:,} bytes{left}; {self.kept}"


def dtype_name(dtype: Any) -> str:
    """The name a dtype is stored under, e.g. "bfloat16"; TypeError for a dtype a checkpoint cannot hold."""
    name = np.dtype(dtype).name  # the same for either byte order; `save` writes little-endian bytes
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {', '.join(DTYPES)}")
    return name


def n_records(nbytes: int, chunk_bytes: int) -> int:
    """How many records a leaf of `nbytes` is stored in: full chunks, then the remainder; none if empty."""
    return -(-nbytes // chunk_bytes)


def records(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """`(start, size)` of each record's payload within a leaf's bytes, in order."""
    for start in range(0, nbytes, chunk_bytes):
        yield start, min(chunk_bytes, nbytes - start)


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


def crc32_array(raw: bytes) -> array.array:
    """A manifest entry's `crc32` bytes (little-endian uint32s) as an array of ints, 4 bytes each: a file of
    millions of records costs 4 bytes per record in memory, not a Python int's 32."""
    return array.array("I", raw)  # native order: readers run on little-endian hosts only (read.py)


@dataclass(frozen=True, slots=True)
class LeafInfo:
    """One manifest entry: a leaf's dotted path, what its bytes are, and where they are in the file.

    For a typed PRNG key, `dtype` and `shape` describe its key data (`jax.random.key_data`) and `key_impl`
    names the implementation (e.g. "threefry2x32"); otherwise `key_impl` is None. Slots and an array of
    checksums keep a manifest of hundreds of thousands of leaves small in memory.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: array.array = field(hash=False)  # one uint32 per chunk (an array is unhashable: the rest is hashed)
    key_impl: str | None
    offset: int  # file offset of the leaf's first record

    @property
    def size_in_file(self) -> int:
        return self.nbytes + RECORD_PREFIX_SIZE * len(self.crc32)

    def record_offset(self, record: int, chunk_bytes: int) -> int:
        """The file offset of record `record`'s prefix (every record before it is a full chunk)."""
        return self.offset + record * (RECORD_PREFIX_SIZE + chunk_bytes)


@dataclass(frozen=True)
class CheckpointInfo:
    """Everything in a checkpoint except the array bytes: what `read_metadata` returns."""

    path: Path
    version: int
    purejax_version: str
    created: str  # ISO 8601, UTC
    step: int | None
    config: Any
    metadata: dict[str | int, Any]
    chunk_bytes: int
    tree: Any  # the tree's containers as saved, each leaf replaced by its index in `leaves` (see nodes.py)
    leaves: tuple[LeafInfo, ...]  # in file order
    size: int  # the file's length in bytes

    @property
    def manifest(self) -> dict[str, LeafInfo]:
        return {leaf.path: leaf for leaf in self.leaves}
