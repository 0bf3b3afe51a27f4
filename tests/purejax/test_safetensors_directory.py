"""safetensors.load_pretrained: the files of a model directory, a single file or the shards an index lists.
Only regular files are opened; a damaged index, or shards that disagree with it, is a SafetensorsError naming
the file and the tensor. Shards are written by the reference implementation (the `safetensors` package)."""

import builtins
import io
import json
import os
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
from hypothesis import HealthCheck, event, given, settings

from purejax import safetensors

INDEX = "model.safetensors.index.json"
A = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, -2], np.int64)}
B = {"c": np.ones((2, 2), np.float16)}


def sharded(directory: Path, shards: dict[str, dict], index: object = None) -> Path:
    """`shards` ({file name: tensors}) written by the reference, and an index: `index` as given (a dict is
    written as JSON, bytes as they are), or else the weight map of the shards as written."""
    directory.mkdir(exist_ok=True)
    for name, tensors in shards.items():
        reference_numpy.save_file(tensors, directory / name)
    if index is None:
        index = {"metadata": {"total_size": 0}, "weight_map": {t: n for n, s in shards.items() for t in s}}
    (directory / INDEX).write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    return directory


def load(directory: Path) -> dict:
    return safetensors.load_pretrained(directory, "model.safetensors", pickle_file="x.bin", how_to_convert="-")


def refused(directory: Path, match: str, path: str = INDEX, entry: str | None = None) -> None:
    """Loading `directory` raises a SafetensorsError matching `match`, naming the file `path` in it and `entry`."""
    with pytest.raises(safetensors.SafetensorsError, match=match) as caught:
        load(directory)
    assert caught.value.path == directory / path and caught.value.entry == entry, str(caught.value)


def test_the_shards_an_index_lists_load_as_the_reference_reads_them(tmp_path):
    directory = sharded(tmp_path / "m", {"m-1.safetensors": A, "m-2.safetensors": B})
    loaded = load(directory)
    expected = reference_numpy.load_file(directory / "m-1.safetensors") | reference_numpy.load_file(
        directory / "m-2.safetensors"
    )
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and loaded[name].tobytes() == value.tobytes(), name


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    """The later shard's copy used to win, silently."""
    weight_map = {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}
    directory = sharded(
        tmp_path / "m", {"m-1.safetensors": A, "m-2.safetensors": {**B, "a": A["a"]}}, {"weight_map": weight_map}
    )
    refused(
        directory, "tensor 'a': is also in the shard 'm-1.safetensors'; which copy is meant", "m-2.safetensors", "a"
    )
    weight_map["a"] = "m-2.safetensors"  # listed in the later shard: found first in the other one
    sharded(directory, {}, {"weight_map": weight_map})
    refused(
        directory, "'a': is in this shard, but model.safetensors.index.json lists it in 'm-2", "m-1.safetensors", "a"
    )


def test_a_tensor_missing_from_its_shard_or_missing_from_the_index_is_refused(tmp_path):
    """A tensor the index lists but its shard lacks used to be left out, silently."""
    weight_map = {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors", "d": "m-2.safetensors"}
    directory = sharded(tmp_path / "m", {"m-1.safetensors": A, "m-2.safetensors": B}, {"weight_map": weight_map})
    refused(directory, "tensor 'd': is missing: .* lists it in this shard", "m-2.safetensors", "d")
    del weight_map["d"], weight_map["b"]
    sharded(directory, {}, {"weight_map": weight_map})
    refused(directory, "tensor 'b': is in this shard, but .* does not list it", "m-1.safetensors", "b")
    weight_map["b"] = "m-1.safetensors"
    sharded(directory, {}, {"weight_map": weight_map})
    (directory / "m-2.safetensors").unlink()
    refused(directory, "lists the shard 'm-2.safetensors', which is not in")


@pytest.mark.parametrize(
    "index, match, entry",
    [
        (b"[1, 2]", "an index must be a JSON object with a 'weight_map'; got a list", None),
        (
            {"metadata": {}},
            r"an index must be a JSON object with a 'weight_map'; got keys \['metadata'\]",
            None,
        ),  # was KeyError
        (
            {"weight_map": ["a"]},
            "'weight_map' must map tensor names to shard files, got list",
            None,
        ),  # was AttributeError
        ({"weight_map": {"a": 3}}, "its shard must be a file name, got 3", "a"),
        ({"weight_map": {"a": None}}, "its shard must be a file name, got None", "a"),
        ({"weight_map": {"a": ["m-1.safetensors"]}}, "its shard must be a file name", "a"),
        *[
            ({"weight_map": {"a": name}}, "is not a file name inside the index's directory", "a")
            for name in ("/etc/passwd", "../m-1.safetensors", "sub/../../m-1.safetensors", "", ".", " ", "m\0")
        ],
        (
            b'{"weight_map": {"a": "m-1.safetensors", "a": "m-1.safetensors"}}',
            r"the index repeats the names \['a'\]",
            None,
        ),
        (b"{" * 1000, "the index nests 1,000 levels deep; at most 16", None),
        (b'{"weight_map": {"a": NaN}}', "the index is not JSON: NaN is not a JSON value", None),
        (b"\xff", "the index is not UTF-8", None),
    ],
)
def test_a_damaged_index_is_refused_naming_the_entry(tmp_path, index, match, entry):
    refused(sharded(tmp_path / "m", {"m-1.safetensors": A}, index), match, entry=entry)


@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_fuzzed_weight_map_loads_consistently_or_is_refused(tmp_path, data):
    """Names and shard files dropped, added, swapped or replaced: whatever loads has every tensor the index
    lists, from the shard it names, and nothing else."""
    weight_map: dict = {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}
    for _ in range(data.draw(st.integers(0, 3))):
        name, change = data.draw(st.sampled_from(["a", "b", "c", "z", ""])), data.draw(st.integers(0, 2))
        if change == 0:
            weight_map.pop(name, None)
        else:
            files = ["m-1.safetensors", "m-2.safetensors", "m-3.safetensors", "./m-2.safetensors", "..", ".", INDEX]
            junk = st.integers() | st.none() | st.text(max_size=3) | st.lists(st.sampled_from(files), max_size=2)
            weight_map[name] = data.draw(st.sampled_from(files) if change == 1 else junk)
    directory = sharded(tmp_path / "m", {"m-1.safetensors": A, "m-2.safetensors": B}, {"weight_map": weight_map})
    try:
        loaded = load(directory)
    except safetensors.SafetensorsError as e:
        assert e.path == directory / INDEX or e.path.parent == directory, str(e)
        event(f"refused: {e.problem[:30]}")
        return
    event("loaded")
    assert sorted(loaded) == sorted(weight_map)
    for name, shard in weight_map.items():
        assert loaded[name].tobytes() == {**A, **B}[name].tobytes() and name in (A if "1" in shard else B)


def test_a_fifo_is_refused_without_being_opened(tmp_path, monkeypatch):
    """Opening a FIFO for reading waits for a writer, for ever: it is refused from its `stat`, and never opened
    (every way of opening it fails the test here instead of hanging it); a shard or an index the same."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifos = [tmp_path / "model.safetensors", tmp_path / "m" / INDEX, tmp_path / "s" / "m-1.safetensors"]
    sharded(tmp_path / "s", {}, {"weight_map": {"a": "m-1.safetensors"}})
    (tmp_path / "m").mkdir()
    for fifo in fifos:
        os.mkfifo(fifo)

    def guard(real):
        def opener(file, *args, **kwargs):
            assert not (isinstance(file, (str, os.PathLike)) and Path(file) in fifos), f"opened the FIFO {file}"
            return real(file, *args, **kwargs)

        return opener

    for module, name in [(os, "open"), (builtins, "open"), (io, "open")]:
        monkeypatch.setattr(module, name, guard(getattr(module, name)))
    for read in (safetensors.load, safetensors.read_header):
        with pytest.raises(safetensors.SafetensorsError, match="model.safetensors: not a regular file: it is a FIFO"):
            read(fifos[0])
    refused(tmp_path, "not a regular file: it is a FIFO", "model.safetensors")
    refused(tmp_path / "m", "not a regular file: it is a FIFO")
    refused(tmp_path / "s", "not a regular file: it is a FIFO", "m-1.safetensors")


def test_a_directory_or_device_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    refused(tmp_path, "not a regular file: it is a directory", "model.safetensors")
    if os.path.exists("/dev/zero"):
        with pytest.raises(safetensors.SafetensorsError, match="/dev/zero: not a regular file: it is a device"):
            safetensors.load("/dev/zero")
    with pytest.raises(FileNotFoundError):
        safetensors.load(tmp_path / "missing.safetensors")
