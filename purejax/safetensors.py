"""Read and write the safetensors format (Hugging Face's weight files) with numpy alone, no extra package.

A file is three parts:

    8 bytes       N, the header's length: an unsigned 64-bit little-endian integer
    N bytes       a JSON object: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                  ..., "__metadata__": {"key": "value"}} (metadata optional, strings only); padded with
                  spaces so the data starts 8-byte aligned
    the rest      every tensor's raw little-endian bytes, row-major; data_offsets count from here and must
                  tile it exactly: no gap, no overlap, nothing left over

Nothing in it is executed on load (unlike pickle), which is why the format exists. `load` memory-maps the
file, so reading a large file costs no memory until an array is touched. bfloat16 and float8 come from
ml_dtypes, which jax depends on. Every malformed header is rejected with an error naming the file and the
entry; the header may be at most 100 MB, as in the reference implementation, so a corrupt length cannot make
the reader allocate without bound.
"""

import json
import math
import os
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

MAX_HEADER_BYTES = 100_000_000

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
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
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


class SafetensorsError(ValueError):
    """The file is not valid safetensors; the message says which part and why."""


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the header of the file at `path` without reading any tensor data."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (8-byte header length)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(
                f"{path}: header length {n:,} exceeds the {MAX_HEADER_BYTES:,}-byte limit; "
                f"the file is corrupt or not safetensors"
            )
        if 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n:,} runs past the end of the {size:,}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as e:
        raise SafetensorsError(f"{path}: the header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")
    tensors = {name: _parse_entry(path, name, entry) for name, entry in header.items()}
    _check_tiling(path, tensors, size - 8 - n)
    return Header(tensors, metadata, 8 + n)


def load(path: str | os.PathLike, *, mmap: bool = True) -> dict[str, np.ndarray]:
    """Every tensor in the file as a numpy array, by name. With `mmap` (default) the arrays are read-only
    views of the memory-mapped file, read from disk when touched; without, they are copies in memory."""
    header = read_header(path)
    buffer = np.memmap(path, dtype=np.uint8, mode="r") if mmap else np.fromfile(path, dtype=np.uint8)
    out = {}
    for name, info in header.tensors.items():
        begin, end = (header.data_start + o for o in info.offsets)
        out[name] = buffer[begin:end].view(DTYPES[info.dtype]).reshape(info.shape)
    return out


def load_pretrained(directory: str | os.PathLike, weights_file: str, *, pickle_file: str, how_to_convert: str) -> dict:
    """Every tensor of a model saved in Hugging Face's directory layout (transformers, diffusers): the single
    `weights_file`, or the shards that `weights_file + ".index.json"` maps. Neither there: a FileNotFoundError
    naming what the directory holds and, if it holds torch's pickle `pickle_file`, how to convert it."""
    directory = Path(directory)
    single, index = directory / weights_file, directory / f"{weights_file}.index.json"
    if single.is_file():
        return load(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {name: a for shard in shards for name, a in load(directory / shard).items()}
    found = sorted(p.name for p in directory.iterdir())
    hint = f" {pickle_file} is torch's pickle format, which needs torch and can run code on load;"
    raise FileNotFoundError(
        f"no {single.name} (or {index.name}) in {directory}; found {found}."
        f"{hint if pickle_file in found else ''} convert it with {how_to_convert}"
    )


def save_pretrained(
    directory: str | os.PathLike, weights_file: str, tensors: Mapping[str, Any], *, max_shard_bytes: int | None = None
) -> None:
    """Write `tensors` in Hugging Face's directory layout, the inverse of `load_pretrained`: one `weights_file`,
    or, when they exceed `max_shard_bytes`, shards `model-00001-of-0000N.safetensors` (for weights_file
    "model.safetensors") filled in the given order, plus `weights_file + ".index.json"` mapping every name to
    its shard, as transformers' `save_pretrained(max_shard_size=...)` writes them. Files of an earlier save
    in the other form are removed, since `load_pretrained` prefers the single file to an index."""
    directory, stem = Path(directory), weights_file.removesuffix(".safetensors")
    shards: list[dict[str, Any]] = [{}]
    filled = 0  # bytes in the last shard
    for name, value in tensors.items():
        size = np.asarray(value).nbytes
        if max_shard_bytes is not None and shards[-1] and filled + size > max_shard_bytes:
            shards.append({})
            filled = 0
        shards[-1][name], filled = value, filled + size
    directory.mkdir(parents=True, exist_ok=True)
    stale = [directory / weights_file, directory / f"{weights_file}.index.json", *directory.glob(f"{stem}-*-of-*")]
    for path in stale:
        path.unlink(missing_ok=True)
    if len(shards) == 1:
        save(directory / weights_file, shards[0], metadata={"format": "pt"})
        return
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save(directory / name, shard, metadata={"format": "pt"})
    total = sum(np.asarray(value).nbytes for value in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {t: n for n, s in zip(names, shards) for t in s}}
    (directory / f"{weights_file}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` ({name: array-like}, any of the dtypes in DTYPES) and string `metadata` to `path`.

    Tensors are laid out by decreasing item size, then name, so each one starts aligned to its item size (the
    reference writer's order). The file is written beside `path` and renamed into place, so a crash never
    leaves a half-written file under the final name."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors.save: metadata must map strings to strings, got {dict(metadata)!r}")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"safetensors.save: tensor names must be strings other than '__metadata__', got {name!r}")
        array = np.asarray(value)
        if array.dtype.newbyteorder("<") not in _NAMES:
            raise TypeError(
                f"safetensors.save: {name!r} has dtype {array.dtype}, which safetensors cannot store; "
                f"supported: {sorted(d.name for d in DTYPES.values())}"
            )
        arrays[name] = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d arrays 0-d
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(arrays[name].tobytes())
    os.replace(tmp, path)


# ---------------------------------------------------------------- validation


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a name given twice is ambiguous (which tensor is it?), so it is an error. Linear in the
    number of names: a header may list tens of thousands of tensors."""
    out = dict(pairs)
    if len(out) < len(pairs):
        repeated = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise _DuplicateKey(f"repeated names {repeated}")
    return out


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_entry(path: Path, name: str, entry: Any) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{where}: an entry needs exactly the keys dtype, shape and data_offsets, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise SafetensorsError(f"{where}: unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise SafetensorsError(f"{where}: data_offsets must be [begin, end] with non-negative ints, got {offsets!r}")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype}{shape} needs {nbytes}"
        )
    return TensorInfo(dtype, tuple(shape), (offsets[0], offsets[1]))


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The tensors' byte ranges must cover the data section exactly, in some order: no gap, no overlap."""
    position, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: item[1].offsets):
        begin, end = info.offsets
        if begin != position:
            what = "overlaps" if begin < position else "leaves a gap after"
            after = f"tensor {previous!r}" if previous else "the start of the data"
            raise SafetensorsError(
                f"{path}: tensor {name!r} at bytes [{begin}, {end}) {what} {after} (ending at byte {position})"
            )
        position, previous = end, name
    if position != data_size:
        raise SafetensorsError(
            f"{path}: the tensors cover {position:,} bytes of data, but the file holds {data_size:,} after the "
            f"header; the file is truncated or has trailing bytes"
        )
