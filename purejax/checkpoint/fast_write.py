"""The fast path of `save`: the reference writer's bytes (sequential.py), at the speed of a plain write.

The file is the same, byte for byte (the tests compare the two); what differs is how the work is shared out.
Writing a checkpoint costs two things of about equal CPU time: copying the bytes into the page cache, and
their CRC-32s. Here one thread does the copies, front to back, from the arrays' memory in pieces of 512 KiB
(each copy stays within the CPU's cache), and tells the kernel every 64 MiB to start writing what came before
to the disk (`posix_fadvise(DONTNEED)`, which on Linux starts writeback), so that the disk works during the
writes instead of all at the final fsync. Meanwhile up to 4 other threads compute the CRC-32s of the large
records 8 MiB at a time, combined into each record's (`crc.crc32_of_pieces`). On two cores a save then
runs at the speed of a plain write of the bytes plus fsync; docs/benchmarks.md has the measurements.
"""

import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import numpy as np

from purejax.checkpoint import format as fmt
from purejax.checkpoint.crc import crc32_of_pieces
from purejax.checkpoint.header import encode_header

_CHECKSUM_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # beside the thread that writes
_SPAN_BYTES = 8 * 2**20  # what one checksum thread takes at a time
_PIECE_BYTES = 512 * 2**10  # one write; also the size below which a record is checksummed by the writer
_WRITEBACK_BYTES = 64 * 2**20  # how often the disk is told to start on what has been written


def write_file(f: BinaryIO, header: dict[str, Any], arrays: Iterable[np.ndarray]) -> None:
    """`sequential.write_file`, fast: header (checksums zeroed), every leaf's records, then the header again
    with the checksums, all written by this thread with `pwrite` while other threads checksum.

    A leaf's checksums are collected before the next leaf is taken from `arrays`, so at most one leaf is
    held beyond the tree itself (a sharded or accelerator leaf is copied to the host as it is taken)."""
    fd = f.fileno()
    placeholder = encode_header(header)
    out = _FrontToBack(fd)
    out.write(placeholder)
    pool = ThreadPoolExecutor(max_workers=_CHECKSUM_THREADS, thread_name_prefix="purejax-checksum")
    try:
        for entry, x in zip(header["leaves"], arrays, strict=True):
            data, records = x.reshape(-1).view(np.uint8), []
            for start, size in fmt.records(data.nbytes, header["chunk_bytes"]):
                record = data[start : start + size]
                if size < _PIECE_BYTES:
                    records.append([(size, zlib.crc32(record))])
                else:
                    spans = [record[i : i + _SPAN_BYTES] for i in range(0, size, _SPAN_BYTES)]
                    records.append([pool.submit(_span_crc, span) for span in spans])
                out.write(fmt.pack_record_prefix(size))
                out.write(record)
            entry["crc32"] = np.asarray([_record_crc(spans) for spans in records], "<u4").tobytes()
    finally:  # after an error (or Ctrl-C), skip the spans not started and wait for those running
        pool.shutdown(wait=True, cancel_futures=True)
    out.flush()
    final = encode_header(header)
    assert len(final) == len(placeholder), "the header changed length when its checksums were filled in"
    _write_at(fd, final, 0)


def _span_crc(span: np.ndarray) -> tuple[int, int]:
    return span.nbytes, zlib.crc32(span)


def _record_crc(spans: list) -> int:
    """A record's CRC-32 from its spans' `(length, CRC-32)`, or futures of them, in order."""
    return crc32_of_pieces(span.result() if hasattr(span, "result") else span for span in spans)


class _FrontToBack:
    """Writes the file front to back: small pieces (record prefixes, small records) gathered into writes of
    about `_PIECE_BYTES`, large ones written from their own memory in pieces of `_PIECE_BYTES`. Every
    `_WRITEBACK_BYTES` the kernel is asked to start writing what came before to disk (`_start_writeback`)."""

    def __init__(self, fd: int):
        self.fd, self.offset, self.started, self.pending = fd, 0, 0, bytearray()

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if len(view) < _PIECE_BYTES:
            self.pending += view
            if len(self.pending) >= _PIECE_BYTES:
                self.flush()
            return
        self.flush()
        for begin in range(0, len(view), _PIECE_BYTES):
            self._write(view[begin : begin + _PIECE_BYTES])

    def flush(self) -> None:
        if self.pending:
            self._write(self.pending)
            self.pending = bytearray()

    def _write(self, data: Any) -> None:
        _write_at(self.fd, data, self.offset)
        self.offset += len(data)
        if self.offset - self.started >= _WRITEBACK_BYTES:
            _start_writeback(self.fd, self.started, self.offset - self.started)
            self.started = self.offset


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes `offset..offset + nbytes` to disk now, and to not keep them
    cached. Without this the disk idles until the final fsync, which then writes the whole file while the
    CPU waits; with it the disk works while the next spans are checksummed and copied. (On Linux,
    `POSIX_FADV_DONTNEED` starts writeback of dirty pages; elsewhere it is a hint or absent.)"""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _write_at(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` at file offset `offset` (no shared file position). Its own function so the crash
    tests can stop a save between any two writes."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
