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
ml_dtypes, which jax depends on.

Files from elsewhere are untrusted input: only a regular file is opened (never a FIFO, which would block, or
a device), and every malformed header or index is a SafetensorsError naming the file and the entry, found at
a cost bounded by the bytes actually there (the checks and their limits: purejax/_safetensors_header.py).
"""

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from purejax._safetensors_header import (
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    Header,
    SafetensorsError,
    TensorInfo,
    read_header,
    read_index,
    read_open_header,
)
from purejax._untrusted import open_regular, short

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "Header",
    "SafetensorsError",
    "TensorInfo",
    "load",
    "load_pretrained",
    "read_header",
    "save",
    "save_pretrained",
]
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def load(path: str | os.PathLike, *, mmap: bool = True) -> dict[str, np.ndarray]:
    """Every tensor in the file as a numpy array, by name. With `mmap` (default) the arrays are read-only
    views of the memory-mapped file, read from disk when touched; without, they are copies in memory."""
    path = Path(path)
    with open_regular(path, lambda problem: SafetensorsError(path, problem)) as f:
        header = read_open_header(f, path)
        if mmap:
            # A plain ndarray view of the map (which it keeps open): slicing a memmap runs Python code per array.
            data = np.memmap(f, dtype=np.uint8, mode="r").view(np.ndarray)[header.data_start :]
        else:
            data = np.empty(os.fstat(f.fileno()).st_size - header.data_start, np.uint8)
            if (n := f.readinto(data)) != data.size:
                raise SafetensorsError(path, f"the file ended after {n:,} of its {data.size:,} bytes of data")
    out = {}
    for name, info in header.tensors.items():
        begin, end = info.offsets
        out[name] = data[begin:end].view(DTYPES[info.dtype]).reshape(info.shape)
    return out


def load_pretrained(directory: str | os.PathLike, weights_file: str, *, pickle_file: str, how_to_convert: str) -> dict:
    """Every tensor of a model saved in Hugging Face's directory layout (transformers, diffusers): the single
    `weights_file`, or the shards that `weights_file + ".index.json"` maps. Neither there: a FileNotFoundError
    naming what the directory holds and, if it holds torch's pickle `pickle_file`, how to convert it."""
    directory = Path(directory)
    single, index = directory / weights_file, directory / f"{weights_file}.index.json"
    if os.path.lexists(single):  # not is_file(): a FIFO or directory there is refused by name, not skipped
        return load(single)
    if os.path.lexists(index):
        return _load_shards(index)
    found = sorted(p.name for p in directory.iterdir())
    hint = f" {pickle_file} is torch's pickle format, which needs torch and can run code on load;"
    raise FileNotFoundError(
        f"no {single.name} (or {index.name}) in {directory}; found {found}."
        f"{hint if pickle_file in found else ''} convert it with {how_to_convert}"
    )


def _load_shards(index: Path) -> dict[str, np.ndarray]:
    """The tensors of the shards `index` lists, each in the shard the index names and in no other: a tensor
    in two shards (which copy is meant?), one missing from its shard, or one the index does not list is a
    SafetensorsError naming the tensor and the shards."""
    weight_map = read_index(index)
    tensors, found_in = {}, {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if not os.path.lexists(path):
            raise SafetensorsError(index, f"lists the shard {short(shard)}, which is not in {index.parent}")
        for name, array in load(path).items():
            if name in found_in:
                problem = f"is also in the shard {short(found_in[name])}; which copy is meant?"
                raise SafetensorsError(path, problem, entry=name)
            if weight_map.get(name) != shard:
                listed = f"lists it in {short(weight_map[name])}" if name in weight_map else "does not list it"
                raise SafetensorsError(path, f"is in this shard, but {index.name} {listed}", entry=name)
            tensors[name], found_in[name] = array, shard
    for name, shard in weight_map.items():
        if name not in found_in:
            raise SafetensorsError(index.parent / shard, f"is missing: {index.name} lists it in this shard", entry=name)
    return tensors


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
