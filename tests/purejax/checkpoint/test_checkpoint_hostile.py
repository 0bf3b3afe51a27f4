"""Hostile and damaged files whose header CRC is correct: every one is refused quickly, with bounded memory,
by a CheckpointError naming the file (and the leaf), never another exception, a hang or a huge allocation.

The files are written here by hand from the specification (docs/checkpoint-format.md) with stock msgpack,
not by purejax's writer, so the writer's own checks cannot hide a reader's gap."""

import copy
import math
import time
import tracemalloc
import zlib
from pathlib import Path

import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from purejax import checkpoint


def write_file(path: Path, header: dict, payload: bytes = b"") -> Path:
    """A file with `header` (its CRC correct) and then `payload` as the records."""
    return write_raw(path, msgpack.packb(header, use_bin_type=True), payload)


def write_raw(path: Path, header: bytes, payload: bytes = b"") -> Path:
    """The preamble as the specification's table lays it out, then `header` and `payload`."""
    length, crc = len(header).to_bytes(4, "big"), zlib.crc32(header).to_bytes(4, "big")
    path.write_bytes(b"\x94\xb2purejax.checkpoint\x01\xce" + length + b"\xce" + crc + header + payload)
    return path


def record(data: bytes) -> bytes:
    return b"\xc6" + len(data).to_bytes(4, "big") + data


def one_leaf(chunk_bytes: int = 64, **entry) -> dict:
    """A header with one leaf "w" (by default float32[2], one record), overridden by `entry`."""
    leaf = {"path": "w", "dtype": "float32", "shape": [2], "nbytes": 8, "crc32": bytes(4), "key_impl": None, **entry}
    return {
        "purejax_version": "0",
        "created": "",
        "step": None,
        "config": None,
        "metadata": {},
        "byte_order": "little",
        "chunk_bytes": chunk_bytes,
        "tree": {"kind": "dict", "keys": ["w"], "children": [{"kind": "leaf", "index": 0}]},
        "leaves": [leaf],
    }


def refused(path: Path, match: str, leaf: str | None = "w", seconds: float = 1.0) -> None:
    """restore (and so read_metadata) raises CheckpointError for `path`, naming it and `leaf`, within `seconds`."""
    start = time.perf_counter()
    with pytest.raises(checkpoint.CheckpointError, match=match) as caught:
        checkpoint.restore(path)
    assert time.perf_counter() - start < seconds
    assert caught.value.path == path and caught.value.leaf == leaf, str(caught.value)


def test_a_shape_of_sixty_thousand_huge_dims_is_refused_at_once(tmp_path):
    path = write_file(tmp_path / "f", one_leaf(shape=[2**64 - 1] * 60_000, nbytes=8), record(bytes(8)))
    refused(path, "60,000 dimensions; at most 64")  # used to take 17.6 s, then a ValueError


@pytest.mark.parametrize(
    "shape, match",
    [
        ([1] * 65, "65 dimensions; at most 64"),
        ([2**63, 0], "larger than any array can be"),  # an empty array, but numpy cannot make it
        ([2**62, 2, 0], "larger than any array can be"),
        ([2**61], "larger than any array can be"),  # 2**63 bytes of float32
        ([2**60], "truncated"),  # 2**62 bytes claimed, 8 in the file
        ([1000], "truncated"),
        ([-1], "is not a list of non-negative integers"),
        ([True], "is not a list of non-negative integers"),
        ("2", "is not a list of non-negative integers"),
    ],
)
def test_impossible_shapes_are_refused(tmp_path, shape, match):
    nbytes = 4 * math.prod(shape) if isinstance(shape, list) else 8
    path = write_file(tmp_path / "f", one_leaf(shape=shape, nbytes=nbytes), record(bytes(8)))
    refused(path, match)


def test_a_claim_of_many_chunks_is_checked_before_anything_per_chunk_is_built(tmp_path):
    """2**27 one-byte chunks claimed in a 200-byte file: it used to build a list per chunk (2.2 GiB)."""
    n = 2**27
    path = write_file(tmp_path / "f", one_leaf(chunk_bytes=1, dtype="uint8", shape=[n], nbytes=n), record(b"x"))
    tracemalloc.start()
    try:
        refused(path, r"truncated: it has \d{3} bytes, and this leaf's records end at byte 805,306,\d{3}")
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [["float32"], {"float32": 1}, 4, None])
def test_a_dtype_that_is_not_a_name_is_refused(tmp_path, dtype):
    refused(write_file(tmp_path / "f", one_leaf(dtype=dtype), record(bytes(8))), "unknown dtype")


@pytest.mark.parametrize("keys", [[["w"]], [{"w": 1}], [b"w"], ["w", "w"]])
def test_dict_keys_that_are_not_distinct_strings_or_ints_are_refused(tmp_path, keys):
    header = one_leaf()
    header["tree"] = {"kind": "dict", "keys": keys, "children": [{"kind": "leaf", "index": 0}] * len(keys)}
    refused(write_file(tmp_path / "f", header, record(bytes(8))), "invalid tree", leaf=None)


def test_dict_keys_of_two_types_are_refused(tmp_path):
    """jax sorts a dict's keys to flatten it, and "w" and 1 cannot be sorted."""
    header = one_leaf()
    header["tree"] = {"kind": "dict", "keys": ["w", 1], "children": [{"kind": "leaf", "index": 0}, {"kind": "none"}]}
    refused(write_file(tmp_path / "f", header, record(bytes(8))), "mixes str and int keys", leaf=None)


def test_a_tree_nested_too_deep_is_refused(tmp_path):
    """510 nested lists: restoring used to recurse until RecursionError; save refuses deeper than 100."""
    tree = {"kind": "leaf", "index": 0}
    for _ in range(510):
        tree = {"kind": "list", "children": [tree]}
    header = one_leaf(path=".".join(["0"] * 510))
    header["tree"] = tree
    refused(write_file(tmp_path / "f", header, record(bytes(8))), "nested more than 100 deep", leaf=None)
    too_deep = np.zeros(1)
    for _ in range(101):
        too_deep = [too_deep]
    with pytest.raises(ValueError, match="nested more than 100 deep"):
        checkpoint.save(tmp_path / "g", too_deep)
    checkpoint.save(tmp_path / "g", too_deep[0])  # 100 deep is fine


@pytest.mark.parametrize(
    "dtype, byte, match",
    [
        ("bool", 2, "bool holds only 0 and 1"),
        ("int4", 0xF7, "int4 holds its value in the low 4 bits"),
        ("float4_e2m1fn", 0x10, "float4_e2m1fn holds its value in the low 4 bits"),
    ],
)
def test_bytes_outside_a_narrow_dtype_are_refused(tmp_path, dtype, byte, match):
    data = bytes([1, 0, byte, 1])
    header = one_leaf(dtype=dtype, shape=[4], nbytes=4, crc32=zlib.crc32(data).to_bytes(4, "little"))
    for threads in (True, False):
        path = write_file(tmp_path / "f", header, record(data))
        with pytest.raises(checkpoint.CheckpointError, match=match) as caught:
            checkpoint.restore(path, threads=threads)
        assert caught.value.leaf == "w" and "element 2" in str(caught.value)


def test_a_directory_or_fifo_is_not_opened_as_a_checkpoint(tmp_path):
    (tmp_path / "dir.msgpack").mkdir()
    for read in (checkpoint.read_metadata, checkpoint.restore):
        with pytest.raises(checkpoint.CheckpointError, match="not a regular file"):
            read(tmp_path / "dir.msgpack")
    if hasattr(__import__("os"), "mkfifo"):
        import os

        os.mkfifo(tmp_path / "fifo.msgpack")  # open() of a FIFO waits for a writer: for ever
        start = time.perf_counter()
        with pytest.raises(checkpoint.CheckpointError, match="not a regular file"):
            checkpoint.restore(tmp_path / "fifo.msgpack")
        assert time.perf_counter() - start < 1
    with pytest.raises(FileNotFoundError):
        checkpoint.restore(tmp_path / "missing.msgpack")


def test_an_io_error_while_reading_is_a_checkpoint_error(tmp_path, monkeypatch):
    checkpoint.save(tmp_path / "f", {"w": np.ones(4)})
    from purejax.checkpoint import sequential

    def failing(fd, view, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sequential, "pread_into", failing)
    for threads in (True, False):
        with pytest.raises(checkpoint.CheckpointError, match="Input/output error"):
            checkpoint.restore(tmp_path / "f", threads=threads)


# A fuzz test over the header's fields: each example replaces one field of a valid file's header (at the top,
# in a manifest entry or in a tree node) by an arbitrary msgpack value, or deletes it; restoring the file must
# succeed or raise CheckpointError, quickly.

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=12)
    | st.sampled_from(["float32", "bool", "int4", "leaf", "dict", "list", "threefry2x32"])
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), children, max_size=4)
    ),
    max_leaves=12,
) | st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=80)
DELETE = object()


def valid_file(path: Path) -> tuple[dict, bytes]:
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "flags": np.array([True, False]), "n": [np.int8(3)]}
    checkpoint.save(path, tree, step=1, chunk_bytes=8)
    raw = path.read_bytes()
    n = int.from_bytes(raw[22:26], "big")
    return msgpack.unpackb(raw[31 : 31 + n], strict_map_key=False), raw[31 + n :]


def places(header: dict) -> list[tuple]:
    """Every (container, key) of the header that the fuzz test may replace."""
    found = [(header, k) for k in header]
    for entry in header["leaves"]:
        found += [(entry, k) for k in entry]
    nodes = [header["tree"]]
    while nodes:
        node = nodes.pop()
        found += [(node, k) for k in node]
        nodes += node.get("children", [])
    return found


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_header_fields_are_refused_with_a_checkpoint_error(tmp_path, data):
    header, records = valid_file(tmp_path / "valid")
    header = copy.deepcopy(header)
    container, key = data.draw(st.sampled_from(places(header)))
    value = data.draw(values | st.just(DELETE))
    if value is DELETE:
        del container[key]
    else:
        container[key] = value
    path = write_file(tmp_path / "fuzzed", header, records)
    for read in (checkpoint.read_metadata, checkpoint.restore):
        try:
            read(path)
        except checkpoint.CheckpointError as e:
            assert e.path == path


@settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_header_bytes_are_refused_with_a_checkpoint_error(tmp_path, data):
    """Arbitrary bytes of the header replaced (its CRC recomputed): decoding errors included."""
    header, records = valid_file(tmp_path / "valid")
    raw = bytearray(msgpack.packb(header, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = write_raw(tmp_path / "fuzzed", bytes(raw), records)
    try:
        checkpoint.restore(path)
    except checkpoint.CheckpointError as e:
        assert e.path == path
