"""The header of a safetensors file, and the index of a sharded one, read as untrusted input: anything
malformed is a SafetensorsError naming the file and the entry, and reading costs time and memory bounded
by the bytes actually there, whatever the file claims.

The checks, each cheap before the next:

- the header's length is at most MAX_HEADER_BYTES (the reference implementation's limit), checked before
  the header is read; an index file is held to the same limit;
- the JSON is scanned before it is decoded (`_untrusted.decode_json`): nested at most MAX_DEPTH deep, and
  at most one array or object per 16 bytes, which every valid header keeps to (see MAX_DEPTH) and which
  bounds the Python objects decoding makes; then decoded as UTF-8, without NaN, Infinity or a name given
  twice, an integer longer than 2**64 - 1's 20 digits left unconverted, so the entry holding it is named;
- each tensor entry is checked, and replaced by a compact TensorInfo, as soon as the decoder has built it,
  so a header of a million entries is never a million dicts and lists at once;
- a shape has at most MAX_NDIM dimensions, and its size is multiplied out one dimension at a time, refused
  as soon as its bytes reach 2**63 (numpy's limit): never a product of huge numbers;
- offsets lie inside the data section, and the tensors tile it: no gap, no overlap, nothing left over.
"""

import functools
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from purejax._untrusted import decode_json, open_regular, short

MAX_HEADER_BYTES = 100_000_000  # the reference's MAX_HEADER_SIZE: a corrupt length cannot make a reader allocate
MAX_NDIM = 64  # numpy's own limit (2.x): no array has more dimensions
_MAX_ARRAY_BYTES = 2**63  # numpy indexes an array's bytes with int64: the non-zero dimensions' bytes stay below
# A valid header nests 3 deep (header, entry, shape) and opens at most one array or object per 16 bytes (an
# entry, 50 bytes at the least, opens three: `"":{"dtype":"U8","shape":[],"data_offsets":[0,0]},`).
MAX_DEPTH = 16
_BYTES_PER_CONTAINER = 16

# safetensors dtype name -> numpy dtype, little-endian (the format's byte order).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    # The format's float8 names: E4M3 is OCP's E4M3FN (no infinities); the FNUZ variants (AMD's and Graphcore's:
    # no infinities, no negative zero, one NaN) and E8M0 (the exponent-only scale of the OCP MX formats) are
    # distinct types with other bit meanings, so each has its own name. ml_dtypes has had all five since 0.5.
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype("<c8"),
}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed, not a regular file, or unreadable. `path` is the file,
    `entry` the tensor concerned (None when the damage is not in one entry), `problem` what is wrong."""

    def __init__(self, path: Any, problem: str, *, entry: str | None = None):
        self.path, self.problem, self.entry = path, problem, entry
        where = f"{path}" if entry is None else f"{path}: tensor {short(entry)}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One header entry: the dtype's safetensors name, the shape, and [begin, end) in the data section."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


@dataclass(frozen=True)
class Header:
    """A parsed, validated header. `data_start` is the file offset of the data section (8 + N)."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the header of the file at `path` without reading any tensor data."""
    path = Path(path)
    with open_regular(path, functools.partial(SafetensorsError, path)) as f:
        return read_open_header(f, path)


def read_open_header(f: BinaryIO, path: Path) -> Header:
    """The header of `f`, a regular file open at its start, which is `path`."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise SafetensorsError(path, f"{size} bytes is too short for a safetensors file (8-byte header length)")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        problem = (
            f"header length {n:,} exceeds the {MAX_HEADER_BYTES:,}-byte limit; the file is corrupt or not safetensors"
        )
        raise SafetensorsError(path, problem)
    if 8 + n > size:
        raise SafetensorsError(path, f"header length {n:,} runs past the end of the {size:,}-byte file")
    data_size = size - 8 - n
    header = _read_json(f, n, path, "header", functools.partial(_entry_or_map, data_size=data_size))
    return _check_header(header, path, data_size, data_start=8 + n)


def read_index(path: Path) -> dict[str, str]:
    """The `weight_map` of a sharded model's index file (`model.safetensors.index.json`): tensor name ->
    shard file, each a relative path inside the index's directory."""
    with open_regular(path, functools.partial(SafetensorsError, path)) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_HEADER_BYTES:
            raise SafetensorsError(path, f"the index is {size:,} bytes, over the {MAX_HEADER_BYTES:,}-byte limit")
        index = _read_json(f, size, path, "index", _no_duplicates)
    if not isinstance(index, dict) or "weight_map" not in index:
        got = f"keys {short(list(index))}" if isinstance(index, dict) else f"a {type(index).__name__}"
        raise SafetensorsError(path, f"an index must be a JSON object with a 'weight_map'; got {got}")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        problem = f"'weight_map' must map tensor names to shard files, got {type(weight_map).__name__}"
        raise SafetensorsError(path, f"{problem} {short(weight_map)}")
    for name, shard in weight_map.items():
        if type(shard) is not str:
            raise SafetensorsError(path, f"its shard must be a file name, got {short(shard)}", entry=name)
        parts = Path(shard).parts  # none for "" and "."
        if not parts or not shard.strip() or "\0" in shard or Path(shard).anchor or ".." in parts:
            problem = f"its shard {short(shard)} is not a file name inside the index's directory"
            raise SafetensorsError(path, problem, entry=name)
    return weight_map


# ---------------------------------------------------------------- decoding


def _read_json(f: BinaryIO, n: int, path: Path, what: str, pairs_hook: Any) -> Any:
    """The next `n` bytes of `f` decoded as JSON, within the limits in the module's docstring."""
    raw = f.read(n)
    if len(raw) < n:
        raise SafetensorsError(path, f"the file ended inside the {what} ({len(raw):,} of {n:,} bytes)")
    limits = {"max_depth": MAX_DEPTH, "max_containers": 2 + n // _BYTES_PER_CONTAINER}
    try:
        return decode_json(raw, pairs_hook=pairs_hook, **limits)
    except ValueError as e:  # not UTF-8, not JSON, too deep, too many containers, a name given twice
        raise SafetensorsError(path, f"the {what} {str(e)[:200]}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a name given twice is ambiguous (which tensor is it?), so it is an error. Linear in the
    number of names: a header may list tens of thousands of tensors."""
    out = dict(pairs)
    if len(out) < len(pairs):
        repeated = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"repeats the names {short(repeated)}")
    return out


# ---------------------------------------------------------------- checking


@dataclass(frozen=True, slots=True)
class _Refused:
    """A JSON object with a tensor entry's keys that failed its checks: the problem is reported, with the
    entry's name, once the whole header is decoded. `original` is the object itself if it may be no tensor
    entry after all (a `__metadata__` map: all strings; or a header whose tensors are named dtype, shape and
    data_offsets: all TensorInfos), else None, so that a header of a million bad entries does not keep them."""

    original: dict | None
    problem: str

    def __repr__(self) -> str:
        return "<an invalid tensor entry>" if self.original is None else short(self.original)


def _entry_or_map(pairs: list[tuple[str, Any]], data_size: int) -> Any:
    """json object hook for a header: a tensor entry becomes its TensorInfo (or a _Refused), any other object
    a dict."""
    obj = _no_duplicates(pairs)
    if obj.keys() != _ENTRY_KEYS:
        return obj
    kinds = {type(v) for v in obj.values()}
    refuse = functools.partial(_Refused, obj if kinds in ({str}, {TensorInfo}) else None)
    dtype, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPES:
        return refuse(f"unsupported dtype {short(dtype)}; supported: {', '.join(DTYPES)}")
    if type(shape) is not list:
        return refuse(f"shape must be a list of non-negative integers, got {short(shape)}")
    if len(shape) > MAX_NDIM:
        return refuse(f"shape has {len(shape):,} dimensions; at most {MAX_NDIM} (numpy's limit)")
    if not all(type(d) is int and d >= 0 for d in shape):
        return refuse(f"shape must be a list of non-negative integers, got {short(shape)}")
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        return refuse(f"data_offsets must be [begin, end], two integers, got {short(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end:
        return refuse(f"data_offsets {offsets} are not [begin, end] with 0 <= begin <= end")
    if end > data_size:
        problem = f"data_offsets {offsets} run past the {data_size:,} bytes of data: the file is truncated"
        return refuse(f"{problem}, or the offsets are wrong")
    extent = DTYPES[dtype].itemsize  # the non-zero dimensions' bytes, which numpy needs below 2**63
    for d in shape:
        extent *= max(d, 1)
        if extent >= _MAX_ARRAY_BYTES:
            return refuse(f"{dtype}{short(shape)} is larger than any array can be (2**63 bytes)")
    nbytes = 0 if 0 in shape else extent
    if end - begin != nbytes:
        return refuse(f"data_offsets {offsets} span {end - begin:,} bytes, but {dtype}{shape} needs {nbytes:,}")
    return TensorInfo(dtype, tuple(shape), (begin, end))


def _check_header(header: Any, path: Path, data_size: int, data_start: int) -> Header:
    """The decoded header, every value a TensorInfo but `__metadata__`'s, as a Header; else a SafetensorsError."""
    header = header.original if isinstance(header, _Refused) and header.original is not None else header
    if not isinstance(header, dict):
        got = "a single tensor entry" if isinstance(header, TensorInfo) else f"a {type(header).__name__}"
        raise SafetensorsError(path, f"the header must be a JSON object of tensor entries, got {got}")
    metadata = header.pop("__metadata__", {})
    metadata = metadata.original if isinstance(metadata, _Refused) and metadata.original is not None else metadata
    if not isinstance(metadata, dict) or not all(type(v) is str for v in metadata.values()):
        raise SafetensorsError(path, f"__metadata__ must map strings to strings, got {short(metadata)}")
    for name, info in header.items():
        if not isinstance(info, TensorInfo):
            expected = f"an entry needs exactly the keys dtype, shape and data_offsets, got {short(info)}"
            raise SafetensorsError(path, info.problem if isinstance(info, _Refused) else expected, entry=name)
    _check_tiling(path, header, data_size)
    return Header(header, metadata, data_start)


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The tensors' byte ranges must cover the data section exactly, in some order: no gap, no overlap."""
    position, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: item[1].offsets):
        begin, end = info.offsets
        if begin != position:
            what = "overlaps" if begin < position else "leaves a gap after"
            after = f"tensor {short(previous)}" if previous is not None else "the start of the data"
            problem = f"at bytes [{begin}, {end}) {what} {after} (ending at byte {position})"
            raise SafetensorsError(path, problem, entry=name)
        position, previous = end, name
    if position != data_size:
        raise SafetensorsError(
            path,
            f"the tensors cover {position:,} bytes of data, but the file holds {data_size:,} after the header; "
            "the file is truncated or has trailing bytes",
        )
