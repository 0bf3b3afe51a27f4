"""The fast path of `restore`: the reference reader's work (sequential.py), spread over 16 threads.

It reads the same records into the same aligned buffers and makes the same checks (the same functions make
them); what differs is that many reads are in flight at once. A disk (above all a network or virtual one)
is kept busy by many outstanding requests, where one sequential reader waits on each in turn; the load times
against one reader and against safetensors are in docs/benchmarks.md ("Checkpoints").

Work is cut into tasks of at most `_SPAN_BYTES` of data: a span of a record, read with `pread` straight into
the leaf's buffer and checksummed 512 KiB at a time while it is still in the CPU's cache (the spans' CRCs
are then combined into the record's, `crc.crc32_of_pieces`); or, for records of 512 KiB or less, a run of
whole records, read by the reference code; or, for leaves of 512 KiB or less, a group of whole leaves. So the
number of tasks follows the data (one per 512 KiB at most), not the number of records or leaves a file claims.
Reading runs at most `_PREFETCH_BYTES` (and `_PREFETCH_LEAVES` leaves) ahead of the leaf being returned, so
restoring onto an accelerator holds only that much on the host at a time.
"""

import collections
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from purejax.checkpoint import format as fmt
from purejax.checkpoint import sequential
from purejax.checkpoint.crc import crc32_of_pieces
from purejax.checkpoint.format import CheckpointError, CheckpointInfo, LeafInfo

_READ_THREADS = 16  # reads in flight at once
_SPAN_BYTES = 8 * 2**20  # the data one task reads
_PIECE_BYTES = 512 * 2**10  # read, then checksummed while in the CPU's cache
_PREFETCH_BYTES = 256 * 2**20
_PREFETCH_LEAVES = 4096  # many small leaves: a bound on the tasks queued for them, too
_GROUP_LEAVES = 1024  # small leaves read by one task, at most

# A leaf's tasks: per record split into spans, `(record, futures of (length, CRC-32))` for the caller to
# combine and check; per run of whole records, `(None, [future])`, checked by the task itself.
Tasks = list[tuple[int | None, list[Future]]]


def read_leaves(fd: int, info: CheckpointInfo, indices: Iterable[int]) -> Iterator[tuple[int, np.ndarray]]:
    """`(i, array)` for the manifest entries `indices`, in file order, each read from the open file `fd`
    into its own aligned buffer and verified: `sequential.read_leaves`, with the reads done by threads.

    Small leaves (at most `_PIECE_BYTES`) are read in groups, one task per `_SPAN_BYTES` (or `_GROUP_LEAVES`)
    of them, so that a tree of hundreds of thousands of tiny leaves costs a task per group, not one per leaf."""
    order = sorted(indices)
    queued, ahead = collections.deque(), 0  # leaves submitted and not yet returned, and their bytes
    group, group_bytes = [], 0  # small leaves not yet submitted
    pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="purejax-read")
    try:
        for n, i in enumerate(order, 1):
            leaf = info.leaves[i]
            if leaf.nbytes <= _PIECE_BYTES:
                group.append((i, sequential.aligned_empty(leaf.nbytes)))
                group_bytes += leaf.nbytes
            if group and (leaf.nbytes > _PIECE_BYTES or group_bytes >= _SPAN_BYTES or len(group) >= _GROUP_LEAVES):
                queued.extend(_submit_group(pool, fd, info, group))  # before a large leaf: the queue is in file order
                group, group_bytes = [], 0
            if leaf.nbytes > _PIECE_BYTES:
                queued.append((i, *_submit_leaf(pool, fd, info, leaf)))
            elif n == len(order):
                queued.extend(_submit_group(pool, fd, info, group))
            ahead += leaf.nbytes
            while queued and (ahead > _PREFETCH_BYTES or len(queued) > _PREFETCH_LEAVES or n == len(order)):
                j, buf, tasks = queued.popleft()
                ahead -= info.leaves[j].nbytes
                yield j, _finish_leaf(info, info.leaves[j], buf, tasks)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error, skip the reads not yet started


def _submit_group(pool: ThreadPoolExecutor, fd: int, info: CheckpointInfo, group: list) -> Iterator[tuple]:
    """One task reading the small leaves `group` (`(i, buffer)` pairs, `_read_group`); each leaf's entry for
    the queue waits on it."""
    future = pool.submit(_read_group, fd, info, group)
    return ((i, buf, [(None, [future])]) for i, buf in group)


def _read_group(fd: int, info: CheckpointInfo, group: list) -> None:
    """Read the small leaves `group` into their buffers: with one read when they lie end to end in the file
    (as a whole restore's do), each record's prefix and CRC-32 then checked from memory; otherwise, or if
    that read comes up short, leaf by leaf with the reference code (which names the leaf that is cut off)."""
    leaves = [info.leaves[i] for i, _ in group]
    start, end = leaves[0].offset, leaves[-1].offset + leaves[-1].size_in_file
    scratch = bytearray(end - start if end - start == sum(leaf.size_in_file for leaf in leaves) else 0)
    if not scratch or sequential.pread_into(fd, memoryview(scratch), start) < len(scratch):
        for leaf, (_, buf) in zip(leaves, group):
            sequential.read_records(fd, info, leaf, buf, 0, len(leaf.crc32))
        return
    view, at = memoryview(scratch), 0
    for leaf, (_, buf) in zip(leaves, group):
        into = memoryview(buf)
        for record, (begin, size) in enumerate(fmt.records(leaf.nbytes, info.chunk_bytes)):
            sequential.check_prefix(info, leaf, record, bytes(view[at : at + fmt.RECORD_PREFIX_SIZE]))
            data = view[at + fmt.RECORD_PREFIX_SIZE : at + fmt.RECORD_PREFIX_SIZE + size]
            into[begin : begin + size] = data
            sequential.check_crc(info, leaf, record, zlib.crc32(data))
            at += fmt.RECORD_PREFIX_SIZE + size


def _submit_leaf(pool: ThreadPoolExecutor, fd: int, info: CheckpointInfo, leaf: LeafInfo) -> tuple[np.ndarray, Tasks]:
    """A new aligned buffer for `leaf`, and the tasks that fill it."""
    buf, tasks, n = sequential.aligned_empty(leaf.nbytes), [], len(leaf.crc32)
    if info.chunk_bytes <= _PIECE_BYTES:  # small records: runs of whole ones, each task about a span of data
        per_task = _SPAN_BYTES // info.chunk_bytes
        for first in range(0, n, per_task):
            stop = min(first + per_task, n)
            tasks.append((None, [pool.submit(sequential.read_records, fd, info, leaf, buf, first, stop)]))
        return buf, tasks
    for record, (start, size) in enumerate(fmt.records(leaf.nbytes, info.chunk_bytes)):
        data_offset = leaf.record_offset(record, info.chunk_bytes) + fmt.RECORD_PREFIX_SIZE
        spans = []
        for begin in range(start, start + size, _SPAN_BYTES):
            span = buf[begin : min(begin + _SPAN_BYTES, start + size)]
            offset, first = data_offset + begin - start, begin == start
            spans.append(pool.submit(_read_span, fd, info, leaf, record, span, offset, first))
        tasks.append((record, spans))
    return buf, tasks


def _read_span(
    fd: int, info: CheckpointInfo, leaf: LeafInfo, record: int, span: np.ndarray, offset: int, first: bool
) -> tuple[int, int]:
    """Read `span`, part of record `record` of `leaf`, from file offset `offset`, checksumming each piece right
    after reading it; the `first` span of a record also checks the record's prefix. Returns `(length, CRC)`."""
    if first:
        prefix = bytearray(fmt.RECORD_PREFIX_SIZE)
        sequential.pread_into(fd, memoryview(prefix), offset - fmt.RECORD_PREFIX_SIZE)
        sequential.check_prefix(info, leaf, record, bytes(prefix))
    view, crc = memoryview(span).cast("B"), 0
    for begin in range(0, len(view), _PIECE_BYTES):
        piece = view[begin : begin + _PIECE_BYTES]
        if sequential.pread_into(fd, piece, offset + begin) < len(piece):
            raise CheckpointError(info.path, f"file is truncated inside record {record}", leaf=leaf.path)
        crc = zlib.crc32(piece, crc)  # right after the read, while the piece is in the cache
    return len(view), crc


def _finish_leaf(info: CheckpointInfo, leaf: LeafInfo, buf: np.ndarray, tasks: Tasks) -> np.ndarray:
    """Wait for `leaf`'s tasks, check each split record's combined CRC-32, and return the leaf's array."""
    for record, futures in tasks:
        results = [future.result() for future in futures]  # re-raises a task's CheckpointError or OSError
        if record is not None:
            sequential.check_crc(info, leaf, record, crc32_of_pieces(results))
    return sequential.leaf_array(info, leaf, buf)
