"""restore and read_metadata: bit-exact round trips of every dtype and node kind, verification of damaged
files, template checks, partial restores, placement with shardings, and bounded memory."""

import functools
import json
from pathlib import Path
from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings

from purejax import checkpoint
from purejax import tree as tree_lib
from purejax.checkpoint import format as fmt
from purejax.tree import TreeMismatchError


def random_array(name: str, shape: tuple, seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, subnormals, negative zero included) of dtype `name`; for the
    sub-byte dtypes only the low bits are set, as ml_dtypes holds them; bools are 0 or 1."""
    dtype = fmt.DTYPES[name]
    raw = np.random.default_rng(seed).integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    if name == "bool":
        raw &= 1
    elif dtype.itemsize == 1 and name not in ("int8", "uint8"):
        info = ml_dtypes.iinfo(dtype) if "int" in name else ml_dtypes.finfo(dtype)
        raw &= (1 << info.bits) - 1
    return raw.view(dtype).reshape(shape)


def same_bits(a, b) -> bool:
    if hasattr(a, "dtype") and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", list(fmt.DTYPES))
def test_every_dtype_round_trips_bit_for_bit(tmp_path, name):
    empty = np.zeros(0, fmt.DTYPES[name])
    tree = {"matrix": random_array(name, (3, 5)), "scalar": random_array(name, (), 1), "empty": empty}
    checkpoint.save(tmp_path / "f", tree, chunk_bytes=7)  # chunks that cut through elements
    loose = checkpoint.restore(tmp_path / "f").tree
    into_numpy = checkpoint.restore(tmp_path / "f", like=tree).tree
    for key, value in tree.items():
        assert same_bits(loose[key], value) and same_bits(into_numpy[key], value), key
        assert type(into_numpy[key]) is np.ndarray
    assert checkpoint.read_metadata(tmp_path / "f").manifest["matrix"].dtype == name


def jax_holds(name: str) -> bool:
    """Whether this jax can put the dtype on a device (not float64 without x64; not float6 in jax 0.10)."""
    dtype = fmt.DTYPES[name]
    try:
        return jax.dtypes.canonicalize_dtype(dtype) == dtype and jax.device_put(np.zeros(2, dtype)).dtype == dtype
    except Exception:
        return False


@pytest.mark.parametrize("name", [n for n in fmt.DTYPES if jax_holds(n)])
def test_jax_arrays_of_every_dtype_restore_as_jax_arrays(tmp_path, name):
    value = jax.device_put(random_array(name, (4, 3)))
    checkpoint.save(tmp_path / "f", {"x": value})
    restored = checkpoint.restore(tmp_path / "f", like={"x": value}).tree["x"]
    assert isinstance(restored, jax.Array) and same_bits(restored, value)
    assert restored.sharding == value.sharding


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_keys_round_trip_as_keys_with_their_implementation(tmp_path, impl):
    keys = {"one": jax.random.key(42, impl=impl), "many": jax.random.split(jax.random.key(7, impl=impl), 3)}
    checkpoint.save(tmp_path / "f", keys)
    leaf = checkpoint.read_metadata(tmp_path / "f").manifest["many"]
    assert (leaf.key_impl, leaf.dtype) == (impl, "uint32")
    for restored in [checkpoint.restore(tmp_path / "f").tree, checkpoint.restore(tmp_path / "f", like=keys).tree]:
        for name, key in keys.items():
            assert restored[name].dtype == key.dtype and same_bits(restored[name], key)
            # The independent check: the restored key draws the same random numbers.
            draw = jax.vmap(jax.random.bits)
            assert jnp.array_equal(draw(restored[name].reshape(-1)), draw(key.reshape(-1)))


def test_raw_uint32_keys_are_plain_arrays(tmp_path):
    key = jax.random.PRNGKey(3)
    checkpoint.save(tmp_path / "f", {"key": key})
    assert checkpoint.read_metadata(tmp_path / "f").leaves[0].key_impl is None
    restored = checkpoint.restore(tmp_path / "f", like={"key": key}).tree["key"]
    assert restored.dtype == jnp.uint32 and same_bits(restored, key)


def test_scalars_round_trip_and_take_the_template_type(tmp_path):
    tree = {"int": 7, "float": 0.1, "bool": True, "complex": 1 - 2j, "np": np.float32(2.5), "zero_d": jnp.int8(3)}
    checkpoint.save(tmp_path / "f", tree)
    loose = checkpoint.restore(tmp_path / "f").tree
    assert {k: v.dtype.name for k, v in loose.items()} == {
        "int": "int64",
        "float": "float64",
        "bool": "bool",
        "complex": "complex128",
        "np": "float32",
        "zero_d": "int8",
    }
    assert all(v.shape == () for v in loose.values())
    typed = checkpoint.restore(tmp_path / "f", like=tree).tree
    for key, value in tree.items():
        assert type(typed[key]) is type(value) or (key == "zero_d" and isinstance(typed[key], jax.Array)), key
        assert typed[key] == value, key


class Stats(NamedTuple):
    mean: object
    var: object


def every_node_kind():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    return {
        "opt_state": optax.adamw(1e-3).init(params),
        "by_step": {1000: jnp.ones(2), 5: jnp.zeros(2)},
        "bn": Stats(mean=jnp.zeros(3), var=jnp.ones(3)),
        "misc": [None, (jnp.ones(1), None), {}, ()],
    }


def test_every_node_kind_round_trips_into_the_template_types(tmp_path):
    tree = every_node_kind()
    checkpoint.save(tmp_path / "f", tree)
    restored = checkpoint.restore(tmp_path / "f", like=tree).tree
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(same_bits, restored, tree)))
    assert type(restored["opt_state"][0]) is type(tree["opt_state"][0])


def test_without_a_template_namedtuples_come_back_as_namedtuples_of_the_same_name(tmp_path):
    tree = every_node_kind()
    checkpoint.save(tmp_path / "f", tree)
    restored = checkpoint.restore(tmp_path / "f").tree
    assert list(tree_lib.flatten(restored)) == list(tree_lib.flatten(tree))
    assert type(restored["bn"]).__name__ == "Stats" and restored["bn"]._fields == ("mean", "var")
    assert list(restored["by_step"]) == [5, 1000] and restored["misc"][0] is None and restored["misc"][2:] == [{}, ()]
    # It drives optax like the original state does.
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = optax.adamw(1e-3).update(grads, jax.tree_util.tree_map(jnp.asarray, restored["opt_state"]), params)
    expected, _ = optax.adamw(1e-3).update(grads, tree["opt_state"], params)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(jnp.array_equal, updates, expected)))


leaves = st.sampled_from(["float32", "bfloat16", "int8", "bool", "complex64"]).flatmap(
    lambda name: st.tuples(st.integers(0, 3), st.integers(0, 2**16)).map(lambda s: random_array(name, (s[0],), s[1]))
)
trees = st.recursive(
    leaves | st.none(),
    lambda children: (
        st.dictionaries(st.text("abc_", min_size=1, max_size=3), children, max_size=3)
        | st.dictionaries(st.integers(-5, 5), children, max_size=3)
        | st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
    ),
    max_leaves=8,
)


@settings(max_examples=25, deadline=None)
@given(tree=trees, chunk_bytes=st.integers(1, 16))
def test_random_trees_round_trip_exactly(tmp_path_factory, tree, chunk_bytes):
    path = tmp_path_factory.mktemp("h") / "f"
    checkpoint.save(path, tree, chunk_bytes=chunk_bytes)
    restored = checkpoint.restore(path).tree
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)
    assert all(map(same_bits, jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(tree)))


def test_template_mismatches_are_reported_all_at_once_and_nothing_is_restored(tmp_path):
    params = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    saved = {"params": params, "step": np.int32(1), "old": np.ones(1)}
    checkpoint.save(tmp_path / "f", saved)
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, ml_dtypes.bfloat16), "gamma": np.ones(3)}
    like = {"params": params, "step": np.int32(0)}
    with pytest.raises(TreeMismatchError) as caught:
        checkpoint.restore(tmp_path / "f", like=like)
    message = str(caught.value)
    assert f"checkpoint {tmp_path / 'f'} does not match" in message
    for line in [
        "missing:        params.gamma",
        "unexpected:     old",
        "shape mismatch: params.w: expected (3, 2), got (2, 3)",
        "dtype mismatch: params.b: expected bfloat16, got float32",
        "to convert dtypes, pass cast=True",
    ]:
        assert line in message
    assert len(message.splitlines()) == 7  # the title, four differences, the legend and the hint


def test_dtypes_are_converted_only_when_asked(tmp_path):
    checkpoint.save(tmp_path / "f", {"n": np.array(16777217, np.int32), "key": jax.random.key(0)})
    exact = checkpoint.restore(tmp_path / "f", like={"n": np.int32(0), "key": jax.random.key(1)}).tree
    assert exact["n"] == 16777217  # orbax restores this as 16777216.0 without being asked
    with pytest.raises(TreeMismatchError, match="dtype mismatch: n: expected float32, got int32"):
        checkpoint.restore(tmp_path / "f", like={"n": np.float32(0), "key": jax.random.key(1)})
    cast = checkpoint.restore(tmp_path / "f", like={"n": np.float32(0), "key": jax.random.key(1)}, cast=True).tree
    assert cast["n"].dtype == np.float32 and cast["n"] == np.float32(16777217)
    with pytest.raises(TreeMismatchError, match="dtype mismatch: key: expected uint32, got key<fry>"):
        checkpoint.restore(tmp_path / "f", like={"n": np.int32(0), "key": jnp.zeros((), jnp.uint32)}, cast=True)


def test_float64_into_a_jax_template_needs_x64(tmp_path):
    checkpoint.save(tmp_path / "f", {"x": np.ones(2)})
    with pytest.raises(ValueError, match="jax_enable_x64"):
        checkpoint.restore(tmp_path / "f", like={"x": jax.ShapeDtypeStruct((2,), np.float64)})
    restored = checkpoint.restore(tmp_path / "f", like={"x": jax.ShapeDtypeStruct((2,), np.float32)}, cast=True).tree
    assert restored["x"].dtype == jnp.float32


def saved_state(path: Path) -> dict:
    state = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "opt": {"mu": np.ones(1000, np.float32)}}
    checkpoint.save(path, state, step=9, config={"lr": 0.1}, metadata={"note": "x"}, chunk_bytes=256)
    return state


def corrupt(path: Path, offset: int, mask: int = 0x01) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def test_partial_restore_reads_only_the_subtree_bytes(tmp_path):
    path = tmp_path / "f"
    state = saved_state(path)
    mu = checkpoint.read_metadata(path).manifest["opt.mu"]
    corrupt(path, mu.offset + 5 + 100)  # damage the optimizer state only
    params, info = checkpoint.restore(path, subtree="params")
    assert np.array_equal(params["w"], state["params"]["w"]) and info.step == 9
    assert same_bits(checkpoint.restore(path, like=state["params"]["w"], subtree="params.w").tree, state["params"]["w"])
    with pytest.raises(checkpoint.CheckpointError, match="fail their CRC32 check") as caught:
        checkpoint.restore(path)
    assert caught.value.leaf == "opt.mu"


def test_metadata_reads_no_array_bytes(tmp_path):
    path = tmp_path / "f"
    saved_state(path)
    info = checkpoint.read_metadata(path)
    for leaf in info.leaves:  # damage every array byte: the metadata does not notice
        for i in range(leaf.nbytes):
            corrupt(path, leaf.offset + 5 + i) if i % 97 == 0 else None
    info = checkpoint.read_metadata(path)
    assert (info.step, info.config, info.metadata) == (9, {"lr": 0.1}, {"note": "x"})
    assert {leaf.path: leaf.shape for leaf in info.leaves} == {"opt.mu": (1000,), "params.w": (3, 4)}


def owner_of(info: fmt.CheckpointInfo, offset: int) -> str | None:
    return next((leaf.path for leaf in info.leaves if leaf.offset <= offset < leaf.offset + leaf.size_in_file), None)


@pytest.mark.parametrize("threads", [True, False], ids=["fast", "reference"])
def test_every_flipped_bit_is_detected_and_located(tmp_path, threads):
    """One flipped bit anywhere -- preamble, header, record framing or data -- is a CheckpointError naming
    the file, and the leaf when the bit is in that leaf's records, by either reader. Never silently wrong
    weights."""
    clean = tmp_path / "clean"
    tree = {"a": np.arange(20, dtype=np.int16), "b": {"c": np.ones(3, np.float32)}}
    checkpoint.save(clean, tree, step=1, chunk_bytes=16)
    info, raw = checkpoint.read_metadata(clean), clean.read_bytes()
    bad = tmp_path / "bad"
    rng = np.random.default_rng(0)
    for offset in range(len(raw)):
        bad.write_bytes(raw)
        corrupt(bad, offset, 1 << int(rng.integers(8)))
        with pytest.raises(checkpoint.CheckpointError) as caught:
            checkpoint.restore(bad, threads=threads)
        assert caught.value.path == bad and str(bad) in str(caught.value)
        assert caught.value.leaf == owner_of(info, offset), (offset, str(caught.value))


def test_records_read_in_many_spans_and_pieces_verify_each_span(tmp_path, monkeypatch):
    """With tiny spans and pieces (save and restore), each record is checksummed in several spans on a save
    and read by several threads in spans on a restore, the spans' CRCs combined: the values round-trip, and
    a flipped bit in the first, a middle or the last span of a record is caught and located."""
    from purejax.checkpoint import fast_read, fast_write

    monkeypatch.setattr(fast_write, "_PIECE_BYTES", 3)
    monkeypatch.setattr(fast_write, "_SPAN_BYTES", 12)
    monkeypatch.setattr(fast_read, "_SPAN_BYTES", 10)
    monkeypatch.setattr(fast_read, "_PIECE_BYTES", 4)
    clean = tmp_path / "clean"
    tree = {"a": random_array("float32", (50,)), "b": random_array("int8", (7,))}
    checkpoint.save(clean, tree, chunk_bytes=64)  # "a": records of 64, 64, 64, 8 bytes
    assert all(same_bits(checkpoint.restore(clean).tree[k], tree[k]) for k in tree)
    info, raw = checkpoint.read_metadata(clean), clean.read_bytes()
    first_data = info.manifest["a"].offset + fmt.RECORD_PREFIX_SIZE + 64 + fmt.RECORD_PREFIX_SIZE  # record 1
    bad = tmp_path / "bad"
    for within in (0, 9, 10, 33, 63):  # spans of record 1: 0..10, 10..20, ..., 60..64
        bad.write_bytes(raw)
        corrupt(bad, first_data + within, 0x10)
        with pytest.raises(checkpoint.CheckpointError, match=r"bytes 64\.\.128 \(record 1\) fail") as caught:
            checkpoint.restore(bad)
        assert caught.value.leaf == "a"


@pytest.mark.parametrize("threads", [True, False], ids=["fast", "reference"])
def test_every_truncation_is_detected_and_located(tmp_path, threads):
    clean = tmp_path / "clean"
    checkpoint.save(clean, {"a": np.arange(20, dtype=np.int16), "b": np.ones(3, np.float32)}, chunk_bytes=16)
    info, raw = checkpoint.read_metadata(clean), clean.read_bytes()
    cut = tmp_path / "cut"
    for length in range(len(raw)):
        cut.write_bytes(raw[:length])
        for read in (checkpoint.read_metadata, functools.partial(checkpoint.restore, threads=threads)):
            with pytest.raises(checkpoint.CheckpointError, match="truncated") as caught:
                read(cut)
            assert caught.value.leaf == owner_of(info, length), length


def test_trailing_bytes_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "f"
    saved_state(path)
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(checkpoint.CheckpointError, match="1 bytes after its last record"):
        checkpoint.read_metadata(path)
    import msgpack

    flax_like = tmp_path / "flax.msgpack"
    flax_like.write_bytes(msgpack.packb({"params": {"w": b"\x00" * 64}}))
    np.savez(tmp_path / "weights.npz", w=np.ones(3))
    for foreign in [flax_like, tmp_path / "weights.npz"]:
        with pytest.raises(checkpoint.CheckpointError, match="not a purejax checkpoint"):
            checkpoint.restore(foreign)


def test_a_missing_subtree_is_named_with_what_is_there(tmp_path):
    path = tmp_path / "f"
    state = saved_state(path)
    with pytest.raises(KeyError, match=r"no 'param' under the root .* it has 'opt', 'params'"):
        checkpoint.restore(path, subtree="param")
    with pytest.raises(TreeMismatchError, match=r"\(subtree 'params'\) does not match"):
        checkpoint.restore(path, like={"w": np.zeros(1)}, subtree="params")
    assert same_bits(checkpoint.restore(path, like=state["opt"], subtree="opt").tree["mu"], state["opt"]["mu"])


def test_sharded_arrays_save_gathered_and_restore_onto_any_sharding(tmp_path, run_child):
    """On 8 simulated devices, saved from a 4x2 mesh, restored onto it, an 8x1 mesh and one device: see
    sharded_child.py for the checks."""
    assert run_child("sharded_child.py", str(tmp_path / "f")).strip().endswith("ok")


@pytest.mark.parametrize("into", ["like", "numpy"])
def test_restore_needs_about_one_copy_of_the_data(big_checkpoint, run_child, into):
    """240 MB restored in a fresh process: the peak RSS grows by the data plus at most 5% (jax adopts the
    aligned read buffers; a copy in device_put, or reading the file into bytes first, would need 2x)."""
    path, _ = big_checkpoint
    measured = json.loads(run_child("peak_memory.py", "restore", str(path), into).strip().splitlines()[-1])
    assert measured["extra"] <= 1.05 * measured["data"], measured
    assert measured.get("jax_arrays", True)
