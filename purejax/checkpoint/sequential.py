"""The reference path: a checkpoint's bytes written and read front to back by one thread.

`save` and `restore` (write.py, read.py) do everything around the bytes -- the tree, the header, the
atomic rename, the template -- and hand the bytes to these two functions when called with `threads=False`.
By default they use the fast path (fast_write.py, fast_read.py), which writes exactly the same bytes and
makes exactly the same checks, only sooner: the tests compare the two byte for byte. Read this file to
see what the I/O of a checkpoint is; read the fast path to see how it is made quick.

Writing (`write_file`): the preamble and header go first with every checksum zeroed (the header's length
does not depend on them: each is a fixed-size bin); then each leaf as records of at most `chunk_bytes`,
each a msgpack bin 32 written straight from the array's memory, its CRC-32 computed on the way; then the
header again, in place, with the checksums. No copy of an array is made, so a save needs no extra memory.

Reading (`read_leaves`): each leaf's records go straight into one new buffer, 64-byte aligned so that
jax adopts it as the array's memory without a copy (numpy's own are 16-byte aligned): a restore needs
1.0x the data. Each record's framing and CRC-32 is checked as it is read, and the values of the dtypes
that use only the low bits of their byte (bool, int4, ...) once the leaf is complete.
"""

import os
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np

from purejax.checkpoint import format as fmt
from purejax.checkpoint.format import CheckpointError, CheckpointInfo, LeafInfo
from purejax.checkpoint.header import encode_header

_ALIGNMENT = 64


def write_file(f: BinaryIO, header: dict[str, Any], arrays: Iterable[np.ndarray]) -> None:
    """Write a whole checkpoint to the new, empty file `f`: `header` (whose leaves' "crc32" are zeroed
    placeholders, filled in here) and the leaves `arrays` (C-contiguous little-endian numpy arrays, in
    manifest order, taken one at a time)."""
    placeholder = encode_header(header)
    f.write(placeholder)
    for entry, x in zip(header["leaves"], arrays, strict=True):
        data, crcs = x.reshape(-1).view(np.uint8), []
        for start, size in fmt.records(data.nbytes, header["chunk_bytes"]):
            record = data[start : start + size]
            f.write(fmt.pack_record_prefix(size))
            f.write(record)
            crcs.append(zlib.crc32(record))
        entry["crc32"] = np.asarray(crcs, "<u4").tobytes()
    final = encode_header(header)
    assert len(final) == len(placeholder), "the header changed length when its checksums were filled in"
    f.seek(0)
    f.write(final)


def read_leaves(fd: int, info: CheckpointInfo, indices: Iterable[int]) -> Iterator[tuple[int, np.ndarray]]:
    """`(i, array)` for the manifest entries `indices`, in file order, each read from the open file `fd`
    into its own aligned buffer and verified."""
    for i in sorted(indices):
        leaf = info.leaves[i]
        buf = aligned_empty(leaf.nbytes)
        read_records(fd, info, leaf, buf, 0, len(leaf.crc32))
        yield i, leaf_array(info, leaf, buf)


def read_records(fd: int, info: CheckpointInfo, leaf: LeafInfo, buf: np.ndarray, first: int, stop: int) -> None:
    """Read records `first` to `stop - 1` of `leaf` into their places in `buf` (the leaf's bytes), checking
    each one's prefix and CRC-32."""
    for record in range(first, stop):
        start = record * info.chunk_bytes
        size = min(info.chunk_bytes, leaf.nbytes - start)
        offset = leaf.record_offset(record, info.chunk_bytes)
        prefix = bytearray(fmt.RECORD_PREFIX_SIZE)
        pread_into(fd, memoryview(prefix), offset)
        check_prefix(info, leaf, record, bytes(prefix))
        data = memoryview(buf[start : start + size])
        if pread_into(fd, data, offset + fmt.RECORD_PREFIX_SIZE) < size:
            raise CheckpointError(info.path, f"file is truncated inside record {record}", leaf=leaf.path)
        check_crc(info, leaf, record, zlib.crc32(data))


def check_prefix(info: CheckpointInfo, leaf: LeafInfo, record: int, prefix: bytes) -> None:
    """CheckpointError unless `prefix` frames record `record` of `leaf`: a bin 32 of the record's length."""
    size = min(info.chunk_bytes, leaf.nbytes - record * info.chunk_bytes)
    if fmt.unpack_record_prefix(prefix) != size:
        problem = f"record {record} should start with a msgpack bin 32 of {size} bytes, found {prefix.hex()}"
        raise CheckpointError(info.path, f"{problem}: the file is corrupt", leaf=leaf.path)


def check_crc(info: CheckpointInfo, leaf: LeafInfo, record: int, crc: int) -> None:
    """CheckpointError unless `crc` is the CRC-32 the manifest lists for record `record` of `leaf`."""
    if crc != (want := leaf.crc32[record]):
        start = record * info.chunk_bytes
        where = f"bytes {start:,}..{min(start + info.chunk_bytes, leaf.nbytes):,} (record {record})"
        problem = f"{where} fail their CRC32 check (stored {want:#010x}, computed {crc:#010x})"
        raise CheckpointError(info.path, f"{problem}: the file is corrupt", leaf=leaf.path)


def leaf_array(info: CheckpointInfo, leaf: LeafInfo, buf: np.ndarray) -> np.ndarray:
    """The verified bytes `buf` as the leaf's array (a view), after checking that a dtype using only the low
    bits of its byte (`format.VALUE_BITS`) has no higher bit set in any element."""
    bits = fmt.VALUE_BITS.get(leaf.dtype)
    if bits is not None and leaf.nbytes and int(buf.max()) >> bits:  # max: a pass with no temporary array
        element = int(np.argmax(buf >> bits > 0))  # the first bad one
        what = "holds only 0 and 1" if leaf.dtype == "bool" else f"holds its value in the low {bits} bits"
        problem = f"element {element} is the byte {int(buf[element]):#04x}, but {leaf.dtype} {what}"
        raise CheckpointError(info.path, f"{problem}: the file is corrupt", leaf=leaf.path)
    return buf.view(fmt.DTYPES[leaf.dtype]).reshape(leaf.shape)


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from file offset `offset` (no shared file position, so threads may call it at once); the
    number of bytes read, fewer only at the end of the file."""
    got = 0
    while got < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[got:]], offset + got)
        else:  # a platform without preadv: os.pread returns new bytes, copied in
            part = os.pread(fd, len(view) - got, offset + got)
            view[got : got + len(part)], n = part, len(part)
        if not n:
            break
        got += n
    return got


def aligned_empty(nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes whose address is a multiple of 64, so jax can adopt them without a copy."""
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % _ALIGNMENT
    return raw[offset : offset + nbytes]
