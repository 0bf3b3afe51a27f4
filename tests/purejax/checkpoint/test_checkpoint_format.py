"""The byte layout of purejax.checkpoint.format, checked against stock msgpack as the independent reader."""

import re
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest

from purejax import checkpoint
from purejax.checkpoint import format as fmt
from purejax.checkpoint import header as header_lib

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("n, crc", [(0, 0), (1, 2), (300, 0xDEADBEEF), (2**32 - 1, 2**32 - 1)])
def test_preamble_is_msgpack_array_of_name_version_length_crc(n, crc):
    raw = fmt.pack_preamble(n, crc)
    assert len(raw) == fmt.PREAMBLE_SIZE == 31
    assert msgpack.unpackb(raw) == ["purejax.checkpoint", 1, n, crc]
    assert fmt.unpack_preamble(raw, "f") == (n, crc) if n <= fmt.MAX_HEADER_BYTES else True


def test_record_prefix_is_bin32_even_for_short_payloads():
    for payload in [b"", b"abc", bytes(70000)]:
        raw = fmt.pack_record_prefix(len(payload)) + payload
        assert raw[0] == 0xC6 and msgpack.unpackb(raw) == payload
        assert fmt.unpack_record_prefix(raw[:5]) == len(payload)
    assert fmt.unpack_record_prefix(msgpack.packb(b"abc")[:5]) is None  # msgpack's own short form is not a record


def test_file_is_a_sequence_of_msgpack_objects_as_specified(tmp_path):
    tree = {"a": np.arange(10, dtype=np.int32), "b": [np.ones((2, 2), np.float16), None], "c": np.zeros(0)}
    checkpoint.save(tmp_path / "f", tree, step=3, config={"x": (1, 2)}, metadata={"m": 1.5}, chunk_bytes=16)
    with open(tmp_path / "f", "rb") as f:
        objects = list(msgpack.Unpacker(f, raw=False, strict_map_key=False))
    preamble, header, *records = objects
    assert preamble[:2] == ["purejax.checkpoint", 1]
    assert list(header) == [
        "purejax_version",
        "created",
        "step",
        "config",
        "metadata",
        "byte_order",
        "chunk_bytes",
        "tree",
        "leaves",
    ]
    assert (header["step"], header["config"], header["metadata"]) == (3, {"x": [1, 2]}, {"m": 1.5})
    assert [leaf["path"] for leaf in header["leaves"]] == ["a", "b.0", "c"]
    # 40 bytes in chunks of 16: 16, 16, 8; 8 bytes: one record; an empty array: none.
    assert [len(r) for r in records] == [16, 16, 8, 8]
    assert b"".join(records[:3]) == tree["a"].tobytes() and records[3] == tree["b"][0].tobytes()
    crcs = [int(c) for leaf in header["leaves"] for c in np.frombuffer(leaf["crc32"], "<u4")]
    assert crcs == [zlib.crc32(r) for r in records]
    # The header's own length and checksum, as the preamble states them.
    raw = (tmp_path / "f").read_bytes()
    assert zlib.crc32(raw[31 : 31 + preamble[2]]) == preamble[3]
    assert msgpack.unpackb(raw[31 : 31 + preamble[2]], strict_map_key=False) == header


def test_leaf_offsets_follow_from_the_header_alone(tmp_path):
    tree = {"a": np.arange(100, dtype=np.uint8), "b": np.arange(7, dtype=np.int64)}
    checkpoint.save(tmp_path / "f", tree, chunk_bytes=30)
    raw = (tmp_path / "f").read_bytes()
    for leaf in checkpoint.read_metadata(tmp_path / "f").leaves:
        first = raw[leaf.offset : leaf.offset + 5 + min(30, leaf.nbytes)]
        assert msgpack.unpackb(first) == tree[leaf.path].tobytes()[:30]
    assert leaf.offset + leaf.size_in_file == len(raw)


def test_dtype_table_covers_every_dtype_jax_has():
    jax_names = [n for n in dir(jnp) if re.fullmatch(r"(u?int|float|bfloat|complex)\d.*", n)]
    for name in jax_names:
        assert np.dtype(getattr(jnp, name)).name in fmt.DTYPES, name
    assert fmt.DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16) and fmt.DTYPES["int4"].itemsize == 1


def test_the_narrow_dtypes_are_those_ml_dtypes_gives_fewer_than_8_bits():
    """Restore refuses a byte with bits set above these widths (format.VALUE_BITS); ml_dtypes is the reference."""
    widths = {"bool": 1}
    for name, dtype in fmt.DTYPES.items():
        if dtype.itemsize == 1 and name != "bool":
            try:
                widths[name] = ml_dtypes.iinfo(dtype).bits
            except ValueError:
                widths[name] = ml_dtypes.finfo(dtype).bits
    assert fmt.VALUE_BITS == {name: bits for name, bits in widths.items() if bits < 8}


@pytest.mark.parametrize("dtype", [object, "U3", "datetime64[s]", [("a", "i4")]])
def test_dtypes_a_checkpoint_cannot_hold_are_named(dtype):
    with pytest.raises(TypeError, match="cannot be stored in a checkpoint; supported: bool"):
        fmt.dtype_name(np.dtype(dtype))


def test_plain_converts_config_values_and_names_what_it_cannot():
    from dataclasses import dataclass

    @dataclass
    class Config:
        d_model: int = 8
        dtype: object = jnp.bfloat16
        sizes: tuple = (1, 2)

    got = header_lib.plain({"c": Config(), "s": np.float32(0.5), "loss": jnp.array(2.0), 3: None}, "config")
    assert got == {"c": {"d_model": 8, "dtype": "bfloat16", "sizes": [1, 2]}, "s": 0.5, "loss": 2.0, 3: None}
    with pytest.raises(TypeError, match=r"config\.model\.fn is a function"):
        header_lib.plain({"model": {"fn": lambda: 0}}, "config")
    with pytest.raises(TypeError, match="config.w is a ArrayImpl"):
        header_lib.plain({"w": jnp.ones(3)}, "config")
    with pytest.raises(TypeError, match="does not fit in 64 bits"):
        header_lib.plain(2**70, "config")


def test_preamble_problems_are_reported_by_kind(tmp_path):
    good = fmt.pack_preamble(10, 0)
    with pytest.raises(checkpoint.CheckpointError, match="not a purejax checkpoint"):
        fmt.unpack_preamble(msgpack.packb({"params": 1}) + bytes(31), "f")
    with pytest.raises(checkpoint.CheckpointError, match="truncated: 12 bytes"):
        fmt.unpack_preamble(good[:12], "f")
    with pytest.raises(checkpoint.CheckpointError, match="format version 2; this purejax reads version 1"):
        fmt.unpack_preamble(good[:20] + b"\x02" + good[21:], "f")
    with pytest.raises(checkpoint.CheckpointError, match="over the 67,108,864-byte limit"):
        fmt.unpack_preamble(fmt.pack_preamble(fmt.MAX_HEADER_BYTES + 1, 0), "f")


def _hand_written(tmp_path, header: dict, payload: bytes = b"") -> Path:
    raw = msgpack.packb(header, use_bin_type=True)
    path = tmp_path / "hostile.msgpack"
    path.write_bytes(fmt.pack_preamble(len(raw), zlib.crc32(raw)) + raw + payload)
    return path


def _header(chunk_bytes: int = 64, **leaf) -> dict:
    entry = {"path": "w", "dtype": "float32", "shape": [2], "nbytes": 8, "crc32": bytes(4), "key_impl": None, **leaf}
    tree = {"kind": "dict", "keys": ["w"], "children": [{"kind": "leaf", "index": 0}]}
    return header_lib.header_dict(
        purejax_version="x",
        created="x",
        step=None,
        config=None,
        metadata={},
        chunk_bytes=chunk_bytes,
        tree=tree,
        leaves=[entry],
    )


@pytest.mark.parametrize(
    "leaf, message",
    [
        ({"dtype": "object"}, "unknown dtype 'object'"),
        ({"shape": [-2]}, "is not a list of non-negative integers"),
        ({"nbytes": 4}, "nbytes 4 does not equal float32"),
        ({"nbytes": 8.0}, "nbytes 8.0 does not equal float32"),
        ({"nbytes": True}, "nbytes True does not equal float32"),
        ({"crc32": bytes(8)}, "crc32 must be 4 bytes"),
        ({"path": 5}, "is not a map with a string 'path'"),
    ],
)
def test_inconsistent_headers_are_refused(tmp_path, leaf, message):
    path = _hand_written(tmp_path, _header(**leaf), fmt.pack_record_prefix(8) + bytes(8))
    with pytest.raises(checkpoint.CheckpointError, match=message) as caught:
        checkpoint.read_metadata(path)
    assert caught.value.path == path


def test_a_header_claiming_terabytes_fails_before_allocating(tmp_path):
    n = 2**40  # 4 TiB of float32: allocating it would raise MemoryError, not CheckpointError
    path = _hand_written(tmp_path, _header(2**30, shape=[n], nbytes=4 * n, crc32=bytes(4 * 4096)))
    with pytest.raises(checkpoint.CheckpointError, match="file is truncated") as caught:
        checkpoint.restore(path)
    assert caught.value.leaf == "w"


def test_foreign_reader_in_the_spec_reads_a_purejax_file_without_purejax_or_jax(tmp_path):
    """The reader printed in docs/checkpoint-format.md, run where purejax and jax cannot be imported."""
    doc = (ROOT / "docs" / "checkpoint-format.md").read_text()
    [reader] = [b for b in re.findall(r"^```python\n(.*?)^```", doc, re.S | re.M) if "def read_checkpoint" in b]
    tree = {
        "w": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
        "q": jnp.array([-8, 7, -1], jnp.int4),
        "f8": jnp.array([1.5, -2.0], jnp.float8_e4m3fn),
        "blocks": [{"x": np.arange(5, dtype=np.int64)}, (np.complex64(1 + 2j), True)],
        "key": jax.random.key(7),
    }
    checkpoint.save(tmp_path / "f.msgpack", tree, step=5, chunk_bytes=8)
    script = (
        "import sys\nsys.modules['jax'] = sys.modules['purejax'] = None  # any import of them fails\n"
        f"{reader}\nheader, arrays = read_checkpoint(sys.argv[1])\n"
        "np.savez(sys.argv[2], **{k: a.reshape(-1).view(np.uint8) for k, a in arrays.items()})\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "f.msgpack"), str(tmp_path / "out.npz")], check=True)
    got = dict(np.load(tmp_path / "out.npz"))
    assert sorted(got) == ["blocks.0.x", "blocks.1.0", "blocks.1.1", "f8", "key", "q", "w"]
    expected = {
        "w": tree["w"],
        "q": tree["q"],
        "f8": tree["f8"],
        "key": jax.random.key_data(tree["key"]),
        "blocks.0.x": tree["blocks"][0]["x"],
        "blocks.1.0": np.complex64(1 + 2j),
        "blocks.1.1": np.bool_(True),
    }
    for name, leaf in expected.items():
        assert got[name].tobytes() == np.asarray(leaf).tobytes(), name
