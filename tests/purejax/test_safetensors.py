"""purejax.safetensors against the reference implementation (the `safetensors` package, Rust), both ways:
files it writes are read here, and files written here are read by it; then every malformed header."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors as reference
import safetensors.numpy as reference_numpy

from purejax import safetensors

RNG = np.random.default_rng(0)

# One tensor of every dtype, including 0-d and empty ones and a non-contiguous view.
TENSORS = {
    "f32": RNG.normal(size=(3, 5)).astype(np.float32),
    "f64": RNG.normal(size=(4,)),
    "f16": RNG.normal(size=(2, 3, 2)).astype(np.float16),
    "bf16": RNG.normal(size=(7,)).astype(ml_dtypes.bfloat16),
    "f8_e4m3": RNG.normal(size=(5,)).astype(ml_dtypes.float8_e4m3fn),
    "f8_e5m2": RNG.normal(size=(5,)).astype(ml_dtypes.float8_e5m2),
    "f8_e4m3fnuz": RNG.normal(size=(3,)).astype(ml_dtypes.float8_e4m3fnuz),
    "f8_e5m2fnuz": RNG.normal(size=(2, 2)).astype(ml_dtypes.float8_e5m2fnuz),
    "f8_e8m0": np.exp2(RNG.integers(-20, 20, size=(4,))).astype(ml_dtypes.float8_e8m0fnu),  # powers of two only
    "i64": RNG.integers(-(2**40), 2**40, size=(3,)),
    "i32": RNG.integers(-100, 100, size=(2, 2)).astype(np.int32),
    "i16": np.array([-3, 7], np.int16),
    "i8": np.array([-128, 127], np.int8),
    "u64": np.array([2**63 + 5], np.uint64),
    "u32": np.array([4_000_000_000], np.uint32),
    "u16": np.array([65535, 1], np.uint16),
    "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
    "bool": np.array([True, False, True]),
    "scalar": np.array(2.5, np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "strided": RNG.normal(size=(4, 6)).astype(np.float32)[:, ::2],
}


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert np.asarray(got[name]).tobytes() == value.tobytes(), name  # bit for bit, NaNs and -0.0 included


def reference_read(path) -> dict:
    """The reference's raw reader: dtype names and bytes, so bfloat16 and float8 need no framework."""
    out = {}
    for name, entry in reference.deserialize(open(path, "rb").read()):
        dtype = safetensors.DTYPES[entry["dtype"]]
        out[name] = np.frombuffer(bytes(entry["data"]), dtype).reshape(entry["shape"])
    return out


def test_reads_what_the_reference_writes(tmp_path):
    path = tmp_path / "ref.safetensors"
    reference_numpy.save_file({k: v.copy(order="C") for k, v in TENSORS.items()}, path, metadata={"format": "pt"})
    assert_same(safetensors.load(path), TENSORS)
    assert_same(safetensors.load(path, mmap=False), TENSORS)
    assert safetensors.read_header(path).metadata == {"format": "pt"}


def test_the_reference_reads_what_we_write(tmp_path):
    path = tmp_path / "ours.safetensors"
    safetensors.save(path, TENSORS, metadata={"format": "pt", "note": "ünïcode"})
    assert_same(reference_read(path), TENSORS)
    with reference.safe_open(path, framework="np") as f:  # the reference's full validation, and its metadata
        assert f.metadata() == {"format": "pt", "note": "ünïcode"}
        np.testing.assert_array_equal(f.get_tensor("f32"), TENSORS["f32"])


def test_layout_is_aligned_and_round_trips(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors.save(path, TENSORS)
    header = safetensors.read_header(path)
    assert header.data_start % 8 == 0
    for info in header.tensors.values():  # each tensor starts at a multiple of its item size
        assert info.offsets[0] % safetensors.DTYPES[info.dtype].itemsize == 0
    loaded = safetensors.load(path)
    assert not loaded["f32"].flags.writeable  # a read-only view of the mapped file
    assert_same(loaded, TENSORS)


def test_the_float8_variants_keep_their_own_names(tmp_path):
    """FNUZ and E8M0 bytes mean other numbers than E4M3FN's and E5M2's: each dtype must round trip as itself,
    under the name the reference gives it."""
    path = tmp_path / "f8.safetensors"
    names = {
        "f8_e4m3": "F8_E4M3",
        "f8_e5m2": "F8_E5M2",
        "f8_e4m3fnuz": "F8_E4M3FNUZ",
        "f8_e5m2fnuz": "F8_E5M2FNUZ",
        "f8_e8m0": "F8_E8M0",
    }
    safetensors.save(path, {k: TENSORS[k] for k in names})
    assert {k: v.dtype for k, v in safetensors.read_header(path).tensors.items()} == names
    for name, entry in reference.deserialize(path.read_bytes()):
        assert entry["dtype"] == names[name]
    reference_numpy.save_file({k: TENSORS[k] for k in names}, tmp_path / "ref.safetensors")
    assert {k: v.dtype for k, v in safetensors.read_header(tmp_path / "ref.safetensors").tensors.items()} == names


def test_a_header_of_many_tensors_reads_and_a_repeated_name_is_named(tmp_path):
    """The header's names were checked for repeats with a quadratic count: 30,000 tensors took 10.6 s to open
    (the reference: 0.1 s); now every check is linear in the header, as the suite's time shows."""
    names = [f"t{i}" for i in range(30_000)]
    entries = ",".join(
        f'"{name}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i, name in enumerate(names)
    )
    path = write_raw(tmp_path / "many.safetensors", ("{" + entries + "}").encode(), bytes(30_000))
    assert list(safetensors.read_header(path).tensors) == names
    write_raw(path, ("{" + entries + ',"t7":{}}').encode(), bytes(30_000))
    with pytest.raises(safetensors.SafetensorsError, match=r"the header repeats the names \['t7'\]"):
        safetensors.load(path)


def test_sixty_four_dimensions_and_names_like_the_entry_keys_read_as_they_are(tmp_path):
    """64 dimensions are numpy's most. The decoder turns every object with an entry's keys into a TensorInfo as
    it goes: tensors named dtype, shape and data_offsets, and metadata with those keys, are still what they are."""
    path = write_raw(tmp_path / "f", header(w=entry(shape=[1] * 63 + [2])), np.arange(2, dtype="<f4").tobytes())
    assert safetensors.load(path)["w"].shape == (1,) * 63 + (2,)
    tensors = {"dtype": entry(), "shape": entry(offsets=(8, 16)), "data_offsets": entry(offsets=(16, 24))}
    metadata = {"dtype": "a", "shape": "b", "data_offsets": "c"}
    path = write_raw(tmp_path / "f", header(__metadata__=metadata, **tensors), np.arange(6, dtype="<f4").tobytes())
    assert safetensors.read_header(path).metadata == metadata
    assert_same(safetensors.load(path), reference_read(path))


def test_big_endian_input_is_stored_little_endian(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors.save(path, {"x": np.arange(3, dtype=">f4")})
    np.testing.assert_array_equal(reference_read(path)["x"], [0.0, 1.0, 2.0])


def test_jax_arrays_can_be_saved(tmp_path):
    import jax.numpy as jnp

    path = tmp_path / "x.safetensors"
    safetensors.save(path, {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)})
    np.testing.assert_array_equal(reference_read(path)["w"].astype(np.float32), np.arange(6).reshape(2, 3))


def test_save_rejects_what_the_format_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match="'s' has dtype <U1"):
        safetensors.save(tmp_path / "x", {"s": np.array(["a"])})
    with pytest.raises(ValueError, match="__metadata__"):
        safetensors.save(tmp_path / "x", {"__metadata__": np.zeros(1)})
    with pytest.raises(TypeError, match="metadata"):  # beartype in the tests, our check without it
        safetensors.save(tmp_path / "x", {"a": np.zeros(1)}, metadata={"n": 1})
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- malformed files


def write_raw(path, header: bytes, data: bytes = b"", length: int | None = None):
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def header(**entries) -> bytes:
    return json.dumps(entries).encode()


MALFORMED = {
    "short": (lambda p: p.write_bytes(b"\x01\x02"), "too short"),
    "huge header length": (lambda p: write_raw(p, b"{}", length=2**40), "exceeds the 100,000,000-byte limit"),
    "header past the end": (lambda p: write_raw(p, b"{}", length=50), "runs past the end"),
    "not json": (lambda p: write_raw(p, b"{nope"), "the header is not JSON: Expecting property name"),
    "not utf-8": (
        lambda p: write_raw(p, b'{"\xff": 1}'),
        "the header is not UTF-8: 'utf-8' codec can't decode byte 0xff",
    ),
    "not an object": (lambda p: write_raw(p, b"[1, 2]"), "must be a JSON object"),
    "duplicate name": (lambda p: write_raw(p, b'{"a": 1, "a": 2}'), r"the header repeats the names \['a'\]"),
    "bad metadata": (lambda p: write_raw(p, header(__metadata__={"n": 1})), "__metadata__ must map strings"),
    "entry keys": (lambda p: write_raw(p, header(a={"dtype": "F32"})), "tensor 'a': an entry needs exactly"),
    "dtype": (lambda p: write_raw(p, header(a=entry(dtype="F12")), b"\0" * 8), "unsupported dtype 'F12'"),
    "shape": (lambda p: write_raw(p, header(a=entry(shape=(-2,))), b"\0" * 8), "shape must be a list of non-negative"),
    "offsets": (
        lambda p: write_raw(p, header(a=entry(offsets=(8, 0))), b"\0" * 8),
        r"\[8, 0\] are not \[begin, end\] with 0 <= begin <= end",
    ),
    "offsets past the data": (
        lambda p: write_raw(p, header(a=entry(offsets=(8, 16))), b"\0" * 8),
        r"\[8, 16\] run past the 8 bytes of data",
    ),
    "size": (lambda p: write_raw(p, header(a=entry(shape=(3,))), b"\0" * 8), r"F32\[3\] needs 12"),
    "gap": (
        lambda p: write_raw(p, header(a=entry(), b=entry(offsets=(12, 20))), b"\0" * 20),
        "tensor 'b': at bytes \\[12, 20\\) leaves a gap after tensor 'a'",
    ),
    "overlap": (
        lambda p: write_raw(p, header(a=entry(), b=entry(offsets=(4, 12))), b"\0" * 12),
        "tensor 'b': at bytes \\[4, 12\\) overlaps tensor 'a'",
    ),
    "truncated data": (
        lambda p: write_raw(p, header(a=entry()), b"\0" * 4),
        "run past the 4 bytes of data: the file is truncated",
    ),
    "trailing data": (lambda p: write_raw(p, header(a=entry()), b"\0" * 9), "cover 8 bytes .* the file holds 9"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_files_are_rejected_with_the_reason(tmp_path, case):
    make, message = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(safetensors.SafetensorsError, match=message) as error:
        safetensors.load(path)
    assert str(path) in str(error.value)
    if case not in ("short", "duplicate name"):  # the reference rejects these too (it tolerates a repeated key)
        with pytest.raises(reference.SafetensorError):
            reference_read(path)
