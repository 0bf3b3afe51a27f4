"""bench/checkpoint.py without timing anything: the trees are GPT-2 small's sizes, each method's save and load
give back the bytes they were handed (on a tiny tree standing in for the 1.5 GB one), and the table's
summaries (the best round, the save over the raw write) are the ones the docstring describes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import checkpoint, checkpoint_methods, checkpoint_trees
from purejax import tree as tree_lib

GPT2_SMALL_PARAMS = 124_439_808  # the published count of GPT-2 small (tied embeddings, 1024 positions)


def data_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_trees_are_gpt2_small_sized():
    """bf16: the params in 2 bytes each (249 MB); adamw: params, mu and nu in 4 bytes each and the step count."""
    bf16, adamw = checkpoint_trees.abstract_tree("bf16"), checkpoint_trees.abstract_tree("adamw")
    assert sum(x.size for x in jax.tree.leaves(bf16)) == GPT2_SMALL_PARAMS
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    assert data_bytes(bf16) == 2 * GPT2_SMALL_PARAMS
    assert data_bytes(adamw) == 3 * 4 * GPT2_SMALL_PARAMS + 4  # + the int32 count


def tiny_abstract(case: str):
    """A stand-in for `abstract_tree`, with both dtypes and the "params" subtree the partial load reads."""
    params = {
        "wte": jax.ShapeDtypeStruct((5, 3), jnp.float32),
        "ln": {"scale": jax.ShapeDtypeStruct((3,), jnp.bfloat16)},
    }
    return {"params": params, "opt_state": {"mu": jax.ShapeDtypeStruct((5, 3), jnp.float32)}}


def tiny_tree():
    leaves, treedef = jax.tree.flatten(tiny_abstract("tiny"))
    made = [jax.random.normal(jax.random.key(i), x.shape).astype(x.dtype) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, made)


@pytest.mark.parametrize("method", ["purejax", "purejax-reference", "safetensors", "numpy"])
def test_each_method_loads_what_it_saved(method, tmp_path, monkeypatch):
    """Every leaf back with its dtype and bits (numpy's bfloat16 goes through uint16 and must come back)."""
    monkeypatch.setattr(checkpoint_methods, "abstract_tree", tiny_abstract)
    tree, path = tiny_tree(), str(tmp_path / "ckpt")
    checkpoint_methods.save_function(method)(tree, path)
    loaded = tree_lib.flatten(checkpoint_methods.load_function(method)(path, "tiny"))
    want = tree_lib.flatten(tree)
    assert sorted(loaded) == sorted(want)
    for name, leaf in want.items():
        assert loaded[name].dtype == leaf.dtype, name
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(leaf), err_msg=name)


def test_purejax_params_loads_the_params_of_a_full_file(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_methods, "abstract_tree", tiny_abstract)
    tree, path = tiny_tree(), str(tmp_path / "ckpt")
    checkpoint_methods.save_function("purejax")(tree, path)
    loaded = checkpoint_methods.load_function("purejax-params")(path, "tiny")
    assert jax.tree.structure(loaded) == jax.tree.structure(tree["params"])
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(tree["params"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_raw_write_is_the_trees_bytes_and_its_read_reports_seconds(tmp_path):
    tree, path = tiny_tree(), tmp_path / "raw"
    assert checkpoint_methods.save_raw(tree, path, piece=7) >= 0.0  # pieces that split leaves
    want = b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree))
    assert path.read_bytes() == want
    assert isinstance(checkpoint_methods.load_raw(path, "tiny"), float)


@pytest.mark.parametrize("method", ["purejax", "numpy"])
def test_a_child_measures_a_save_then_a_load(method, tmp_path, monkeypatch):
    """The child's protocol in this process (`python -m bench.checkpoint --child` runs the same function): the
    save reports the file's size and the data's, the load two times (from the disk, then the page cache)."""
    for module in (checkpoint, checkpoint_methods):
        monkeypatch.setattr(module, "abstract_tree", tiny_abstract)
    monkeypatch.setattr(checkpoint, "make_tree", lambda case: tiny_tree())
    monkeypatch.setattr(checkpoint.time, "sleep", lambda seconds: None)
    path = str(tmp_path / "ckpt")
    saved = checkpoint.child("save", method, "tiny", path)
    assert saved["data"] == data_bytes(tiny_abstract("tiny")) == 5 * 3 * 4 * 2 + 3 * 2
    assert saved["size"] == (tmp_path / "ckpt").stat().st_size >= saved["data"]
    loaded = checkpoint.child("load", method, "tiny", path)
    assert set(loaded) == {"seconds", "warm", "extra", "data"} and loaded["data"] == saved["data"]


def test_an_unknown_method_is_named():
    with pytest.raises(KeyError, match="save_nope"):
        checkpoint_methods.save_function("nope")


def run(seconds: float, extra: float, warm: float | None = None) -> dict:
    out = {"seconds": seconds, "extra": extra, "data": 100}
    return out if warm is None else {**out, "warm": warm}


def test_best_takes_the_fastest_round_and_the_largest_memory():
    rounds = [(run(3.0, 0.1), run(2.0, 1.5, warm=0.4)), (run(1.0, 0.5), run(4.0, 1.0, warm=0.3))]
    saved, loaded = checkpoint.best(rounds)
    assert (saved["seconds"], saved["extra"]) == (1.0, 0.5)
    assert (loaded["seconds"], loaded["warm"], loaded["extra"]) == (2.0, 0.3, 1.5)


def test_best_reports_an_error_of_any_round():
    rounds = [(run(1.0, 0.0), run(1.0, 1.0, warm=1.0)), (run(1.0, 0.0), {"error": "boom"})]
    assert checkpoint.best(rounds)[1] == {"error": "boom"}


def test_save_ratio_is_the_median_of_the_rounds_ratios():
    """Per round 4/1, 2/2, 9/3: the median is 3, where best against best would say 2/1."""
    method = [(run(4.0, 0), {}), (run(2.0, 0), {}), (run(9.0, 0), {})]
    raw = [(run(1.0, 0), {}), (run(2.0, 0), {}), (run(3.0, 0), {})]
    assert checkpoint.save_ratio(method, raw) == 3.0
    assert math.isnan(checkpoint.save_ratio(method, None))
