"""What a header costs a reader: memory a small multiple of its size, whatever it holds.

msgpack is far denser than Python: one byte is an empty list, four a one-entry dict, a few a new NamedTuple
class. Before the header was read value by value against a budget (purejax/checkpoint/stream.py), a valid
60 MB header of empty lists took 4 GiB to read. Each test builds a header of a few MB and measures the peak
memory Python allocates while reading it (tracemalloc: a count of bytes, not a time). The files with a crafted
header are written by hand with stock msgpack, as in test_checkpoint_hostile.py."""

import tracemalloc
import zlib
from pathlib import Path
from typing import NamedTuple

import jax
import msgpack
import numpy as np
import pytest

from purejax import checkpoint
from purejax.checkpoint import fast_read, stream

# What a reader may build, plus the slots of the arrays it is filling (8 bytes an element, at least a byte
# each), plus the header's own bytes: so many bytes per byte of header, at most.
BOUND = stream.MAX_HEADER_EXPANSION + 8 + 1


def write_raw(path: Path, header: bytes, payload: bytes = b"") -> Path:
    """The preamble as docs/checkpoint-format.md lays it out, then `header` and `payload`."""
    length, crc = len(header).to_bytes(4, "big"), zlib.crc32(header).to_bytes(4, "big")
    path.write_bytes(b"\x94\xb2purejax.checkpoint\x01\xce" + length + b"\xce" + crc + header + payload)
    return path


def one_leaf_header(**fields) -> dict:
    """A header with one leaf "w" (float32[2], one record of 8 zero bytes), fields overridden by `fields`."""
    crc = zlib.crc32(bytes(8)).to_bytes(4, "little")
    leaf = {"path": "w", "dtype": "float32", "shape": [2], "nbytes": 8, "crc32": crc, "key_impl": None}
    tree = {"kind": "dict", "keys": ["w"], "children": [{"kind": "leaf", "index": 0}]}
    fixed = {"purejax_version": "0", "created": "", "step": None, "config": None, "byte_order": "little"}
    return {**fixed, "metadata": {}, "chunk_bytes": 64, "tree": tree, "leaves": [leaf], **fields}


ONE_RECORD = b"\xc6" + (8).to_bytes(4, "big") + bytes(8)


def peak_memory(read, *args) -> tuple[int, object]:
    """The peak bytes Python allocates during `read(*args)`, and what it returned or raised."""
    tracemalloc.start()
    try:
        result = read(*args)
    except checkpoint.CheckpointError as e:
        result = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, result


def test_a_header_of_empty_lists_is_refused_within_its_budget(tmp_path):
    """100,000 empty lists, 100 kB of metadata: they would take 6.4 MB as Python lists."""
    n = 100_000
    raw = msgpack.packb(one_leaf_header(metadata={"x": 0}), use_bin_type=True)
    marker = msgpack.packb({"x": 0})
    raw = raw.replace(marker, b"\x81\xa1x\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
    path = write_raw(tmp_path / "f", raw, ONE_RECORD)
    peak, error = peak_memory(checkpoint.restore, path)
    assert isinstance(error, checkpoint.CheckpointError) and error.path == path
    assert f"the header decodes to more than {16 * len(raw) + 2**20:,} bytes of Python objects" in str(error)
    assert peak < BOUND * len(raw) + 2**20, f"{peak / len(raw):.1f} times the header"


def test_nested_claims_of_long_arrays_allocate_nothing(tmp_path):
    """A thousand arrays nested, each claiming 5,000 elements, in 9 kB: msgpack allocates an array's slots as it
    reads its length, so decoding this took 40 MB; the header is found incomplete before anything is built."""
    n = 5_000
    raw = msgpack.packb(one_leaf_header(metadata={"x": 0}), use_bin_type=True)
    raw = raw.replace(msgpack.packb({"x": 0}), b"\x81\xa1x" + (b"\xdd" + n.to_bytes(4, "big")) * 1000 + bytes(4000))
    path = write_raw(tmp_path / "f", raw, ONE_RECORD)
    peak, error = peak_memory(checkpoint.read_metadata, path)
    assert isinstance(error, checkpoint.CheckpointError) and "not valid msgpack" in str(error)
    assert peak < BOUND * len(raw) + 2**20


def test_metadata_a_reader_would_refuse_is_refused_by_save(tmp_path):
    with pytest.raises(ValueError, match="readers would refuse this checkpoint: the header decodes to more than"):
        checkpoint.save(tmp_path / "f", {"w": np.zeros(2)}, metadata={"x": [[] for _ in range(50_000)]})
    checkpoint.save(tmp_path / "f", {"w": np.zeros(2)}, metadata={"x": list(range(50_000))})  # numbers are fine


def test_many_leaves_cost_a_few_times_their_header(tmp_path):
    """2,000 leaves: 300 kB of manifest and tree. Decoded whole, they took ten times that."""
    tree = {"blocks": [{"attention_weight": np.zeros(1, np.float32), "bias_term": np.zeros(2)} for _ in range(1000)]}
    path = checkpoint.save(tmp_path / "f", tree)
    header_bytes = checkpoint.read_metadata(path).leaves[0].offset
    peak, info = peak_memory(checkpoint.read_metadata, path)
    assert peak < 6 * header_bytes, f"{peak / header_bytes:.1f} times the header"
    assert len(info.leaves) == 2000 and info.tree["blocks"][999] == {"attention_weight": 1998, "bias_term": 1999}


def test_many_records_cost_four_bytes_each(tmp_path):
    """One leaf of 50,000 one-byte records: 200 kB of checksums, which as Python ints took 1.8 MB."""
    n = 50_000
    data = np.arange(n, dtype=np.uint8)
    crcs = np.array([zlib.crc32(bytes([b])) for b in range(256)], "<u4")[data]
    header = one_leaf_header(chunk_bytes=1)
    header["leaves"][0].update(dtype="uint8", shape=[n], nbytes=n, crc32=crcs.tobytes())
    records = np.empty((n, 6), np.uint8)
    records[:, :5], records[:, 5] = np.frombuffer(b"\xc6\x00\x00\x00\x01", np.uint8), data
    raw = msgpack.packb(header, use_bin_type=True)
    path = write_raw(tmp_path / "f", raw, records.tobytes())
    peak, info = peak_memory(checkpoint.read_metadata, path)
    assert len(info.leaves[0].crc32) == n and info.leaves[0].crc32[300] == zlib.crc32(bytes([300 % 256]))
    assert peak < 5 * len(raw), f"{peak / len(raw):.1f} times the header"
    assert (checkpoint.restore(path, threads=False).tree["w"] == data).all()


def test_many_namedtuple_classes_are_refused_within_the_budget(tmp_path):
    """2,000 distinct NamedTuple kinds, 60 bytes each in the header: making their classes takes ~6 KiB each."""
    children = [
        {"kind": "namedtuple", "name": f"T{i}", "module": "m", "fields": ["a"], "children": [{"kind": "none"}]}
        for i in range(2000)
    ]
    header = one_leaf_header()
    header["tree"] = {"kind": "list", "children": [{"kind": "leaf", "index": 0}, *children]}
    header["leaves"][0]["path"] = "0"
    raw = msgpack.packb(header, use_bin_type=True)
    peak, error = peak_memory(checkpoint.restore, write_raw(tmp_path / "f", raw, ONE_RECORD))
    assert isinstance(error, checkpoint.CheckpointError) and "the header decodes to more than" in str(error)
    assert peak < BOUND * len(raw) + 2**20


def test_a_long_key_over_many_leaves_is_refused_before_their_paths_are_built(tmp_path):
    """One 100 kB key above 1,000 leaves: their dotted paths would be 100 MB; the manifest's are short."""
    header = one_leaf_header()
    leaves = [{**header["leaves"][0], "path": f"k.{i}"} for i in range(1000)]
    node = {"kind": "list", "children": [{"kind": "leaf", "index": i} for i in range(1000)]}
    header.update(leaves=leaves, tree={"kind": "dict", "keys": ["k" * 100_000], "children": [node]})
    raw = msgpack.packb(header, use_bin_type=True)
    peak, error = peak_memory(checkpoint.restore, write_raw(tmp_path / "f", raw, ONE_RECORD * 1000))
    assert isinstance(error, checkpoint.CheckpointError)
    assert "manifest entry 0 is 'k.0', the tree puts 'kkk" in str(error)
    assert peak < BOUND * len(raw) + 2**20


class Pair(NamedTuple):
    first: object
    second: object


def reorder(value):
    """`value` with every map's keys in reverse order: a node's children before its kind and keys."""
    if isinstance(value, dict):
        return {k: reorder(v) for k, v in reversed(value.items())}
    return [reorder(v) for v in value] if isinstance(value, list) else value


def test_maps_are_read_in_any_key_order(tmp_path):
    """The specification lets a writer put a map's keys in any order: children before the names that say
    which key each child is at, the manifest before chunk_bytes."""
    tree = {"b": {"x": np.arange(3), "y": None}, "a": [Pair(np.ones(2), (np.zeros(1),))], "c": {1: np.int8(5)}}
    raw = checkpoint.save(tmp_path / "f", tree, step=3, config={"lr": 0.1}).read_bytes()
    n = int.from_bytes(raw[22:26], "big")
    header = reorder(msgpack.unpackb(raw[31 : 31 + n], strict_map_key=False))
    assert list(header)[0] == "leaves" and list(header["tree"])[0] == "children"
    reordered = msgpack.packb(header, use_bin_type=True)
    assert len(reordered) == n  # so the records' offsets are unchanged
    restored, info = checkpoint.restore(write_raw(tmp_path / "g", reordered, raw[31 + n :]))
    assert info.step == 3 and info.config == {"lr": 0.1}
    assert restored["b"]["y"] is None and (restored["b"]["x"] == np.arange(3)).all() and restored["c"][1] == 5
    assert type(restored["a"][0]).__name__ == "Pair" and (restored["a"][0].second[0] == 0).all()


def test_small_leaves_are_read_in_groups_in_file_order(tmp_path, monkeypatch):
    """The fast reader reads small leaves a group per task (fast_read.py); a large leaf between them, and a
    group split by its size limit, keep every leaf in its place."""
    monkeypatch.setattr(fast_read, "_GROUP_LEAVES", 3)
    tree = {"a": [np.full(3, i) for i in range(10)], "b": np.arange(2**17.0), "c": [np.full(2, -i) for i in range(5)]}
    path = checkpoint.save(tmp_path / "f", tree)  # "b" is 1 MiB: read on its own
    for like in (None, jax.tree.map(np.zeros_like, tree)):
        got = checkpoint.restore(path, like=like).tree
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True))
