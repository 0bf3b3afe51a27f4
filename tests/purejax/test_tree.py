"""purejax.tree: dotted paths, counts, casts, global norm (against optax and numpy), the summary table and the
structural diff that must report every difference at once."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import tree


class AdamState(NamedTuple):
    mu: dict
    count: jax.Array


def nested():
    """A tree with every node kind purejax meets: string and int dict keys, a list, a tuple, a NamedTuple."""
    return {
        "blocks": [{"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, {"w": jnp.full((2, 3), 2.0), "b": jnp.ones(3)}],
        "heads": {0: jnp.arange(4.0), 1: jnp.arange(5, dtype=jnp.int32)},
        "pair": (jnp.ones(1), jnp.zeros((1, 1))),
        "adam": AdamState(mu={"w": jnp.ones(2)}, count=jnp.zeros((), jnp.int32)),
    }


# ----------------------------------------------------------------------------------------------- flatten


def test_flatten_paths_name_every_node_kind():
    flat = tree.flatten(nested())
    assert set(flat) == {
        "blocks.0.w",
        "blocks.0.b",
        "blocks.1.w",
        "blocks.1.b",
        "heads.0",
        "heads.1",
        "pair.0",
        "pair.1",
        "adam.mu.w",
        "adam.count",
    }
    np.testing.assert_array_equal(flat["blocks.1.w"], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(flat["heads.1"], np.arange(5))


def test_flatten_keeps_jax_leaf_order():
    t = nested()
    assert [id(x) for x in tree.flatten(t).values()] == [id(x) for x in jax.tree_util.tree_leaves(t)]


def test_flatten_treats_none_as_an_empty_node():
    assert list(tree.flatten({"a": None, "b": {"c": jnp.ones(1), "d": None}})) == ["b.c"]


def test_flatten_refuses_colliding_paths():
    with pytest.raises(ValueError, match=r"'a\.b'.*must not contain '\.'"):
        tree.flatten({"a.b": jnp.ones(1), "a": {"b": jnp.ones(2)}})


def test_flatten_unflatten_round_trip():
    params = {"wte": {"w": jnp.ones((5, 3))}, "blocks": {"attn": {"qkv": {"w": jnp.ones((3, 9)), "b": jnp.zeros(9)}}}}
    flat = tree.flatten(params)
    assert set(flat) == {"wte.w", "blocks.attn.qkv.w", "blocks.attn.qkv.b"}
    back = tree.unflatten(flat)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    chex.assert_trees_all_equal(back, params)


nested_dicts = st.recursive(
    st.integers(0, 3).map(lambda n: np.arange(n, dtype=np.float32)),
    lambda children: st.dictionaries(st.text("abcxyz_", min_size=1, max_size=3), children, min_size=1, max_size=3),
    max_leaves=12,
).filter(lambda t: isinstance(t, dict))


@settings(max_examples=30, deadline=None)
@given(nested_dicts)
def test_flatten_unflatten_round_trip_random_trees(t):
    back = tree.unflatten(tree.flatten(t))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(t)
    chex.assert_trees_all_equal(back, t)


def test_unflatten_refuses_a_path_through_a_leaf():
    with pytest.raises(ValueError, match=r"'a\.b' passes through the leaf 'a'"):
        tree.unflatten({"a": 1, "a.b": 2})
    with pytest.raises(ValueError, match=r"path 'a' names a node that already has children"):
        tree.unflatten({"a.b": 1, "a": 2})


def test_unflatten_like_restores_lists_tuples_namedtuples_and_int_keys():
    like = nested()
    flat = {p: np.asarray(x) + 1 for p, x in tree.flatten(like).items()}
    back = tree.unflatten_like(like, flat)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(like)
    assert isinstance(back["blocks"], list) and isinstance(back["pair"], tuple)
    assert isinstance(back["adam"], AdamState) and set(back["heads"]) == {0, 1}
    chex.assert_trees_all_equal(back, jax.tree_util.tree_map(lambda x: np.asarray(x) + 1, like))


def test_unflatten_like_reports_every_missing_and_unexpected_path():
    flat = tree.flatten(nested())
    del flat["blocks.1.w"], flat["adam.count"]
    flat["blocks.2.w"] = jnp.ones(1)
    flat["extra"] = jnp.ones(1)
    with pytest.raises(tree.TreeMismatchError) as err:
        tree.unflatten_like(nested(), flat)
    msg = str(err.value)
    for line in (
        "missing:        blocks.1.w",
        "missing:        adam.count",
        "unexpected:     blocks.2.w",
        "unexpected:     extra",
    ):
        assert line in msg


def test_subtree_follows_flatten_paths():
    t = nested()
    assert tree.subtree(t, "") is t
    assert tree.subtree(t, "blocks.1") is t["blocks"][1]
    assert tree.subtree(t, "adam.mu") is t["adam"].mu
    assert tree.subtree(t, "heads.0") is t["heads"][0]  # an int dict key, written as in a path
    for path, leaf in tree.flatten(t).items():  # every flattened path leads to its leaf
        assert tree.subtree(t, path) is leaf


def test_subtree_names_the_missing_part_and_what_is_there():
    t = nested()
    with pytest.raises(KeyError, match=r"no 'nu' under adam \(looking up 'adam.nu.w'\); it has 'mu', 'count'"):
        tree.subtree(t, "adam.nu.w")
    with pytest.raises(KeyError, match=r"no '2' under blocks .* it has '0', '1'"):
        tree.subtree(t, "blocks.2")
    with pytest.raises(KeyError, match=r"no 'x' under blocks.0.w .* nothing \(a leaf or an empty node\)"):
        tree.subtree(t, "blocks.0.w.x")


def test_subtree_follows_every_prefix_of_a_flatten_path():
    t = nested()
    for path, leaf in tree.flatten(t).items():
        assert tree.subtree(t, path) is leaf
    assert tree.subtree(t, "") is t
    assert tree.subtree(t, "blocks.1") is t["blocks"][1]
    assert tree.subtree(t, "heads.0") is t["heads"][0]  # an int key, named as flatten names it
    assert tree.subtree(t, "adam.mu") is t["adam"].mu
    assert tree.subtree({"a": None}, "a") is None


# ---------------------------------------------------------------------------------------- counts and casts


def test_count_and_nbytes():
    t = {
        "w": jnp.ones((3, 4), jnp.float32),  # 12 elements, 48 bytes
        "h": jnp.ones((5,), jnp.bfloat16),  # 5, 10
        "ids": jnp.ones((2, 2), jnp.int8),  # 4, 4
        "s": jnp.zeros((), jnp.float32),  # 1, 4
        "key": jax.random.key(0),  # 1, 8 (threefry key data: two uint32)
    }
    assert tree.count(t) == 12 + 5 + 4 + 1 + 1
    assert tree.nbytes(t) == 48 + 10 + 4 + 4 + 8
    assert tree.nbytes(t) == sum(x.nbytes for x in jax.tree_util.tree_leaves(t))
    assert tree.count({}) == 0 and tree.nbytes({}) == 0


def test_count_and_nbytes_of_shape_structs():
    shapes = jax.eval_shape(lambda: {"w": jnp.ones((7, 3), jnp.bfloat16), "b": jnp.zeros(3)})
    assert tree.count(shapes) == 24
    assert tree.nbytes(shapes) == 7 * 3 * 2 + 3 * 4


def test_cast_floating_casts_floats_and_leaves_everything_else_alone():
    t = {
        "w": jnp.ones((2, 2), jnp.float32),
        "h": jnp.ones(2, jnp.float16),
        "ids": jnp.arange(3, dtype=jnp.int32),
        "mask": jnp.array([True, False]),
        "step": jnp.zeros((), jnp.uint32),
        "key": jax.random.key(0),
    }
    out = tree.cast_floating(t, jnp.bfloat16)
    assert out["w"].dtype == jnp.bfloat16 and out["h"].dtype == jnp.bfloat16
    assert out["ids"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_ and out["step"].dtype == jnp.uint32
    assert out["key"].dtype == t["key"].dtype
    np.testing.assert_array_equal(out["ids"], t["ids"])
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.ones((2, 2)))


# ----------------------------------------------------------------------------------------------- global norm


def test_global_norm_matches_optax_tree_norm():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(7, 5)), rng.normal(size=3)
    t = {"a": jnp.asarray(a, jnp.float32), "b": [jnp.asarray(b, jnp.float32)], "c": jnp.float32(-2.5)}
    np.testing.assert_allclose(tree.global_norm(t), optax.tree.norm(t), rtol=1e-6)


def test_global_norm_matches_float64_numpy_for_low_precision_and_complex_leaves():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 33)) * 100  # bf16 squares summed in bf16 lose ~3 digits; float32 accumulation must not
    b = rng.normal(size=(17,)) + 1j * rng.normal(size=(17,))
    t = {"a": jnp.asarray(a, jnp.bfloat16), "b": jnp.asarray(b, jnp.complex64)}
    a_rounded = np.asarray(t["a"], np.float64)  # what the bf16 leaf actually holds
    want = np.sqrt(np.sum(a_rounded**2) + np.sum(np.abs(b) ** 2))
    got = tree.global_norm(t)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_global_norm_of_empty_tree_is_zero():
    assert float(tree.global_norm({})) == 0.0


# ------------------------------------------------------------------------------------------------ diff


def test_diff_of_identical_structures_is_ok():
    a = nested()
    report = tree.diff(a, jax.tree_util.tree_map(jnp.zeros_like, a))
    assert report.ok and report.format("params") == "params matches"
    tree.assert_like(a, a)


def test_diff_reports_every_missing_unexpected_shape_and_dtype_mismatch_at_once():
    expected = {
        "wte": {"w": jnp.zeros((65, 8))},
        "blocks": {"qkv": {"w": jnp.zeros((8, 24)), "b": jnp.zeros(24)}, "proj": {"w": jnp.zeros((8, 8))}},
        "ln_f": {"scale": jnp.zeros(8), "bias": jnp.zeros(8)},
    }
    got = {
        "wte": {"w": jnp.zeros((64, 8))},  # shape
        "blocks": {"qkv": {"w": jnp.zeros((8, 24), jnp.bfloat16), "b": jnp.zeros(12, jnp.float16)}},  # dtype, both
        "ln_f": {"scale": jnp.zeros(8)},  # ln_f.bias missing, blocks.proj.w missing
        "lm_head": {"w": jnp.zeros((8, 65))},  # unexpected
        "extra": jnp.zeros(()),  # unexpected
    }
    report = tree.diff(got, expected)
    assert report.missing == ["blocks.proj.w", "ln_f.bias"]
    assert report.unexpected == ["extra", "lm_head.w"]
    assert report.shape == [("blocks.qkv.b", (24,), (12,)), ("wte.w", (65, 8), (64, 8))]
    assert report.dtype == [("blocks.qkv.b", "float32", "float16"), ("blocks.qkv.w", "float32", "bfloat16")]

    with pytest.raises(tree.TreeMismatchError) as err:
        tree.assert_like(got, expected, "checkpoint")
    msg = str(err.value)
    assert msg.startswith("checkpoint does not match the expected structure:")
    for line in (
        "missing:        blocks.proj.w",
        "missing:        ln_f.bias",
        "unexpected:     extra",
        "unexpected:     lm_head.w",
        "shape mismatch: wte.w: expected (65, 8), got (64, 8)",
        "shape mismatch: blocks.qkv.b: expected (24,), got (12,)",
        "dtype mismatch: blocks.qkv.w: expected float32, got bfloat16",
        "dtype mismatch: blocks.qkv.b: expected float32, got float16",
    ):
        assert line in msg, f"{line!r} not in\n{msg}"
    assert isinstance(err.value, ValueError)  # callers may catch the broader class


def test_diff_without_dtype_check_and_against_eval_shape():
    init = lambda: {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}  # noqa: E731
    shapes = jax.eval_shape(init)
    bf16 = {"w": jnp.zeros((3, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16)}
    assert [p for p, *_ in tree.diff(bf16, shapes).dtype] == ["b", "w"]
    assert tree.diff(bf16, shapes, check_dtype=False).ok
    tree.assert_like(init(), shapes)


def test_diff_compares_key_leaves_by_key_type():
    a = {"key": jax.random.key(0)}
    tree.assert_like(a, {"key": jax.random.key(1)})
    with pytest.raises(tree.TreeMismatchError, match="dtype mismatch: key: expected key<fry>, got uint32"):
        tree.assert_like({"key": jax.random.PRNGKey(0)}, a)


# --------------------------------------------------------------------------------------- summary and flops


def test_describe():
    assert tree.describe(jnp.zeros((65, 384))) == "float32[65,384]"
    assert tree.describe(jnp.zeros((), jnp.bfloat16)) == "bfloat16[]"
    assert tree.describe(jax.random.key(0)) == "key<fry>[]"


def test_summary_lists_every_leaf_and_the_totals():
    params = {"fc": {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}, "emb": jnp.zeros((10, 2), jnp.bfloat16)}
    lines = tree.summary(params).splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "count", "bytes"]
    rows = {line.split()[0]: line for line in lines[2:-2]}
    assert set(rows) == {"fc.w", "fc.b", "emb"}
    assert rows["fc.w"].split() == ["fc.w", "(3,", "4)", "float32", "12", "48", "B"]
    assert rows["fc.b"].split() == ["fc.b", "(4,)", "float32", "4", "16", "B"]
    assert rows["emb"].split() == ["emb", "(10,", "2)", "bfloat16", "20", "40", "B"]
    assert lines[-1].split() == ["total", "36", "104", "B"]
    assert set(lines[1]) == set(lines[-2]) == {"-", " "}
    assert not any(line.startswith("flops") for line in lines)


def test_summary_human_bytes_and_thousands():
    text = tree.summary({"w": jax.ShapeDtypeStruct((1000, 1500), jnp.float32)})
    assert text.splitlines()[-1].split() == ["total", "1,500,000", "6.0", "MB"]


def test_summary_flops_of_a_matmul_is_2mnk():
    m, k, n = 8, 16, 32
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    assert tree.flops(jnp.matmul, a, b) == pytest.approx(2 * m * n * k, rel=0.01)
    last = tree.summary({"w": b}, jnp.matmul, a, b).splitlines()[-1]
    assert last.startswith("flops: ") and last.endswith("(XLA cost analysis)")
    assert float(last.split()[1].replace(",", "")) == pytest.approx(2 * m * n * k, rel=0.01)


def test_global_norm_with_specs_of_replicated_leaves_needs_no_mesh():
    """Per-leaf specs: a replicated leaf (P()) is never reduced, so on one device the norm is the plain one
    (the 8-device check, with sharded leaves, is in tests/purejax/parallel/test_step.py)."""
    from jax.sharding import PartitionSpec as P

    t = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4)}
    want = np.sqrt(np.sum(np.arange(6.0) ** 2) + 4)
    np.testing.assert_allclose(tree.global_norm(t, specs={"a": P(), "b": P(None)}), want, rtol=1e-6)
    with pytest.raises(ValueError, match="give axis_name .* or specs .*, not both"):
        tree.global_norm(t, "data", specs={"a": P(), "b": P()})
