"""Hostile and damaged safetensors files: every one is refused by a SafetensorsError naming the file (and the
tensor), never another exception, a hang, or memory its bytes do not pay for; and what still loads, loads
exactly as the reference implementation (the `safetensors` package) reads it. Then the same for the index
of a sharded model.

The files are written here by hand from the format (an 8-byte length, the JSON header, the data) with stock
json, not by purejax's writer, so the writer's own checks cannot hide a reader's gap."""

import json
import struct
import tracemalloc
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import safetensors as reference
import safetensors.numpy as reference_numpy
from hypothesis import HealthCheck, event, given, settings

from purejax import safetensors


def write_file(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def one_tensor(**entry) -> dict:
    """A header with one tensor "w", F32[2] at [0, 8), its fields overridden by `entry`."""
    return {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **entry}}


def peak_bytes(read) -> tuple[object, int]:
    """What `read()` returns (or the exception it raises), and the most memory it held at once."""
    tracemalloc.start()
    try:
        try:
            result = read()
        except Exception as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refused(path: Path, match: str, entry: str | None = "w") -> safetensors.SafetensorsError:
    """`load(path)` raises a SafetensorsError matching `match` that names `path` and `entry`."""
    with pytest.raises(safetensors.SafetensorsError, match=match) as caught:
        safetensors.load(path)
    assert caught.value.path == path and caught.value.entry == entry, str(caught.value)
    assert str(caught.value).startswith(f"{path}: " + ("" if entry is None else f"tensor {entry!r}: "))
    return caught.value


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("shape", [1] * 65, "shape has 65 dimensions; at most 64"),  # was numpy's ValueError at reshape
        ("shape", [2**64 - 1] * 100_000, "shape has 100,000 dimensions; at most 64"),  # was a quadratic product
        ("shape", [2**62, 0], r"F32\[4611686018427387904, 0\] is larger than any array can be"),  # empty, too big
        ("shape", [2**61], "is larger than any array can be"),  # 2**63 bytes of float32
        ("shape", [2**60], r"span 8 bytes, but F32\[1152921504606846976\] needs 4,611,686,018,427,387,904"),
        *[
            ("shape", v, "shape must be a list of non-negative integers")
            for v in ([-1], [True], [2.0], [[2]], "2", None)
        ],
        *[("dtype", v, "unsupported dtype") for v in (["F32"], {"F32": 1}, 4, None, "f32", "F32 ", "float32")],
        *[("data_offsets", v, r"must be \[begin, end\], two integers") for v in ([0], [0, 8, 8], [0, 8.0], {"0": 8})],
        ("data_offsets", [-8, 0], r"are not \[begin, end\] with 0 <= begin <= end"),
        ("data_offsets", [0, 2**64 - 1], r"run past the 8 bytes of data"),
    ],
)
def test_impossible_entries_are_refused(tmp_path, field, value, match):
    """Each used to be a TypeError (a list dtype), a ValueError from numpy, or a hang; now it names the entry."""
    refused(write_file(tmp_path / "f", one_tensor(**{field: value}), bytes(8)), match)


def test_a_5000_digit_integer_is_refused_naming_its_entry(tmp_path):
    """Python refuses to convert more than 4,300 digits (a ValueError that named nothing): the decoder leaves
    such a number unconverted, and the entry's check names the entry."""
    digits = "9" * 5000
    header = '{"w": {"dtype": "F32", "shape": [%s], "data_offsets": [0, 8]}}'
    refused(write_file(tmp_path / "f", (header % digits).encode(), bytes(8)), "an integer of 5,000 characters")
    refused(write_file(tmp_path / "f", (header % ("-" + digits)).encode(), bytes(8)), "an integer of 5,001")
    offsets = header.replace("[%s]", "[2]").replace("[0, 8]", f"[0, {digits}]")
    refused(write_file(tmp_path / "f", offsets.encode(), bytes(8)), "data_offsets must be")
    metadata = '{"__metadata__": {"n": ' + digits + "}}"
    refused(write_file(tmp_path / "f", metadata.encode()), "__metadata__ must map strings to strings", entry=None)


@pytest.mark.parametrize("depth", [17, 1000, 100_000])
def test_deep_nesting_is_refused_before_it_is_decoded(tmp_path, depth):
    """1,000 nested lists raised RecursionError from json; now the nesting is measured before decoding."""
    nested = "[" * depth + "]" * depth
    for text in (nested, '{"w": ' + nested + "}", '{"__metadata__": {"a": ' + nested + "}}"):
        refused(write_file(tmp_path / "f", text.encode()), r"the header nests [\d,]+ levels deep; at most 16", None)
    brackets_in_a_name = "[" * 1000  # strings are not nesting
    path = write_file(tmp_path / "f", {brackets_in_a_name: one_tensor()["w"]}, bytes(8))
    assert list(safetensors.load(path)) == [brackets_in_a_name]


def test_nesting_within_the_limit_reaches_the_entry_checks(tmp_path):
    header = json.dumps(one_tensor(shape=[[[[[[[[[[2]]]]]]]]]])) + " " * 200  # padding: room for its 12 lists
    refused(write_file(tmp_path / "f", header.encode(), bytes(8)), "shape must be a list")


def test_a_header_of_empty_containers_is_refused_before_it_is_decoded(tmp_path):
    """Three bytes of `[],` decode to a 56-byte list: a 99 MB header of them took 2.6 GiB. A valid header opens
    at most one array or object per 16 bytes; this one is refused having allocated about nothing."""
    path = write_file(tmp_path / "f", b'{"w": [' + b"[]," * 1_000_000 + b"[]]}")
    error, peak = peak_bytes(lambda: safetensors.load(path))
    assert isinstance(error, safetensors.SafetensorsError) and error.path == path
    assert error.problem == "the header opens 1,000,003 arrays and objects in 3,000,011 bytes; at most 187,502"
    assert peak < 32 * 2**20  # the scan's buffers and the header's bytes; decoding it took 64 MB


def test_a_header_of_many_entries_costs_a_small_multiple_of_its_bytes(tmp_path):
    """Each entry is checked and made a compact TensorInfo as soon as it is decoded: the dicts and lists json
    builds for it are never all held at once (they were: 15 times the header's bytes)."""
    n = 5_000
    entries = ",".join(f'"{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n))
    header = ("{" + entries + "}").encode()
    path = write_file(tmp_path / "f", header, bytes(n))
    read, peak = peak_bytes(lambda: safetensors.read_header(path))
    assert len(read.tensors) == n and peak < 11 * len(header)


def test_a_claimed_header_length_is_checked_before_anything_is_read(tmp_path):
    path = write_file(tmp_path / "f", b"{}", length=99_999_999)
    error, peak = peak_bytes(lambda: safetensors.load(path))
    assert str(error) == f"{path}: header length 99,999,999 runs past the end of the 10-byte file"
    assert peak < 2**20
    refused(write_file(tmp_path / "f", b"{}", length=2**64 - 1), "exceeds the 100,000,000-byte limit", None)


@pytest.mark.parametrize(
    "text, match",
    [
        (b'{"w": NaN}', "the header is not JSON: NaN is not a JSON value"),
        (b'{"w": -Infinity}', "the header is not JSON: -Infinity is not a JSON value"),
        (b"\xef\xbb\xbf{}", "the header is not JSON: Unexpected UTF-8 BOM"),
        (b'{"w": 1} {}', "the header is not JSON: Extra data"),
        (b"", "the header is not JSON: Expecting value"),
        (b'"w"', "the header must be a JSON object of tensor entries, got a str"),
        (json.dumps(one_tensor()["w"]).encode(), "got a single tensor entry"),
        (b'{"__metadata__": {"a": 1}}', "__metadata__ must map strings to strings"),
        (b'{"__metadata__": null}', "__metadata__ must map strings to strings"),
    ],
)
def test_headers_that_are_not_a_map_of_entries_are_refused(tmp_path, text, match):
    refused(write_file(tmp_path / "f", text, bytes(8)), match, entry=None)


# ---------------------------------------------------------------- fuzzing
# Each example damages a valid file: one header field replaced by an arbitrary JSON value (huge and deep ones
# included) or deleted, or its bytes flipped, cut, extended or replaced. Loading must then raise a
# SafetensorsError naming the file, or load what the reference loads, bit for bit. Derandomized: the same
# examples every run.

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class Raw:
    """JSON text put into a header as it is: what json.dumps cannot write (5,000 digits, NaN, -0)."""

    def __init__(self, text: str):
        self.text = text


RAW = [
    "9" * 5000,
    "-" + "9" * 25,
    "18446744073709551616",
    "1e999",
    "-0",
    "NaN",
    "Infinity",
    "[" * 17 + "]" * 17,
    "[" * 2000 + "]" * 2000,
    "[" + "[]," * 3000 + "[]]",
    '"\\u0000"',
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(["F32", "BF16", "U8", "BOOL", "F8_E8M0", "__metadata__"])
    | st.sampled_from(RAW).map(Raw)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.text(max_size=4) | st.sampled_from(["dtype", "shape", "data_offsets"]), children, max_size=4
        )
    ),
    max_leaves=12,
) | st.lists(st.integers(0, 2**64 - 1), max_size=80)


def dumps(header: dict) -> bytes:
    raws: list[str] = []

    def placeholder(value: Raw) -> str:
        raws.append(value.text)
        return f"\0raw{len(raws) - 1}\0"

    text = json.dumps(header, default=placeholder)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0raw{i}\0"), raw)
    return text.encode()


def valid_file() -> tuple[dict, bytes]:
    """The header (with metadata, an empty and a 0-d tensor) and the data of a file the reference writes."""
    arrays = {"w": np.arange(6, dtype="<f4").reshape(2, 3), "n": np.array([-1, 2**40]), "flags": np.ones(3, bool)}
    raw = reference_numpy.save({**arrays, "empty": np.zeros((0, 4), "<f2"), "scalar": np.array(7, "u1")}, {"a": "b"})
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def places(header: dict) -> list[tuple]:
    """Every (container, key) the fuzz test may replace: the header's, each entry's and the metadata's keys, an
    entry's new key, and each number in a shape or data_offsets."""
    found = [(header, k) for k in header] + [(header, "extra")]
    for name, entry in header.items():
        found += [(entry, k) for k in entry] + ([] if name == "__metadata__" else [(entry, "extra")])
        found += [(entry[k], i) for k in ("shape", "data_offsets") if k in entry for i in range(len(entry[k]))]
    return found


def reference_read(path: Path) -> dict:
    tensors = reference.deserialize(path.read_bytes())
    return {name: (e["dtype"], list(e["shape"]), bytes(e["data"])) for name, e in tensors}


def loads_as_the_reference_does_or_is_refused(path: Path) -> None:
    try:
        ours = safetensors.load(path)
    except safetensors.SafetensorsError as e:
        assert e.path == path, str(e)
        event(f"refused: {e.problem.split(':')[0][:40]}")  # pytest --hypothesis-show-statistics lists them
        with pytest.raises(safetensors.SafetensorsError):  # the header alone is refused just the same
            safetensors.read_header(path)
        return
    header = safetensors.read_header(path)
    got = {name: (header.tensors[name].dtype, list(a.shape), a.tobytes()) for name, a in ours.items()}
    assert got == reference_read(path)  # and the reference must accept what we accept
    event("loaded")


@FUZZ
@given(data=st.data())
def test_fuzzed_header_fields_are_refused_or_read_as_the_reference_reads_them(tmp_path, data):
    header, payload = valid_file()
    container, key = data.draw(st.sampled_from(places(header)))
    change = data.draw(st.sampled_from(["replace", "delete", "rename"]))
    if change == "replace":
        container[key] = data.draw(values)
    elif change == "delete" and (isinstance(container, list) or key in container):
        del container[key]
    elif change == "rename" and isinstance(container, dict) and key in container:
        container[data.draw(st.text(max_size=4) | st.sampled_from(["__metadata__", "w", "dtype"]))] = container.pop(key)
    loads_as_the_reference_does_or_is_refused(write_file(tmp_path / "fuzzed.safetensors", dumps(header), payload))


@FUZZ
@given(data=st.data())
def test_fuzzed_bytes_are_refused_or_read_as_the_reference_reads_them(tmp_path, data):
    header, payload = valid_file()
    raw = bytearray(struct.pack("<Q", len(dumps(header))) + dumps(header) + payload)
    damage = data.draw(st.sampled_from(["bytes", "cut", "insert", "length", "random"]))
    if damage == "bytes":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif damage == "cut":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif damage == "insert":
        at = data.draw(st.integers(8, len(raw)))
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16) | st.sampled_from([b" ", b"[", b"{", b"\\", b'"']))
    elif damage == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1) | st.integers(0, len(raw))))
    else:
        raw = bytearray(data.draw(st.binary(max_size=64)))
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(bytes(raw))
    loads_as_the_reference_does_or_is_refused(path)
