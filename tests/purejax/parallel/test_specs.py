"""purejax.parallel.specs: specs from path rules, uneven splits, specs of a whole training state, placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from purejax import optim, parallel
from purejax.parallel import MODEL

SHAPES = {"emb": {"w": jnp.zeros((8, 4))}, "fc": {"w": jnp.zeros((4, 6)), "b": jnp.zeros(6)}}
RULES = ((r"emb\.w", P(MODEL, None)), (r"fc\.w", P(None, MODEL)), (r".*", P()))


def test_rules_first_match_wins_and_roles_map_to_axes():
    assert parallel.specs_from_rules(SHAPES, RULES, {MODEL: "tp"}) == {
        "emb": {"w": P("tp", None)},
        "fc": {"w": P(None, "tp"), "b": P()},
    }
    off = parallel.specs_from_rules(SHAPES, RULES, {MODEL: None})  # no tensor parallelism: all whole
    assert off["emb"]["w"] == P(None, None)


def test_a_param_no_rule_matches_is_an_error():
    with pytest.raises(ValueError, match=r"no sharding rule matches the param 'fc.b' \(6,\)"):
        parallel.specs_from_rules(SHAPES, RULES[:2], {MODEL: "tp"})


def test_spec_axes_flattens_tuple_entries_in_order():
    assert parallel.spec_axes(P("data", None, ("model", "pipe"))) == ("data", "model", "pipe")
    assert parallel.spec_axes(P()) == parallel.spec_axes(P(None, None)) == ()


def test_local_shape_and_uneven_splits():
    assert parallel.local_shape((8, 6), P("a", "b"), {"a": 4, "b": 3}) == (2, 2)
    with pytest.raises(ValueError, match=r"fc.w \(4, 6\): dimension 1 \(6\) cannot be split evenly over the 4 "):
        parallel.local_shape((4, 6), P(None, "tp"), {"tp": 4}, "fc.w")
    with pytest.raises(ValueError, match=r"loss \(\): its spec .* has more entries than the array has dimensions"):
        parallel.local_shape((), P("data"), {"data": 2}, "loss")
    with pytest.raises(ValueError, match=r"names mesh axis 'model', but the mesh has axes \{'data': 2\}"):
        parallel.local_shape((4, 6), P("data", "model"), {"data": 2})


def test_check_divisible_refuses_trees_of_different_structure():
    shapes = {"a": jax.ShapeDtypeStruct((4,), "float32"), "b": jax.ShapeDtypeStruct((6,), "float32")}
    parallel.check_divisible(shapes, {"a": P("x"), "b": P(None)}, {"x": 2})
    with pytest.raises(ValueError):
        parallel.check_divisible(shapes, {"a": P("x")}, {"x": 2})


def test_state_specs_follow_the_params():
    specs = parallel.specs_from_rules(SHAPES, RULES, {MODEL: "tp"})
    state = optim.init_train_state(SHAPES, optim.adamw(1e-3), jax.random.key(0))
    got = parallel.state_specs(state, specs)
    assert got.params == specs and got.step == P() and got.key == P()
    flat = dict(zip(_paths(got.opt_state), jax.tree.leaves(got.opt_state)))
    assert {p: s for p, s in flat.items() if s != P()} == {
        p: s for p, s in flat.items() if p.endswith(("emb.w", "fc.w"))
    } and len([p for p in flat if p.endswith("emb.w")]) == 2  # mu and nu


def test_state_specs_refuse_factored_optimizer_state():
    specs = parallel.specs_from_rules(SHAPES, RULES, {MODEL: "tp"})
    state = optim.init_train_state(SHAPES, optim.adafactor(1e-3, min_dim_size_to_factor=2), jax.random.key(0))
    with pytest.raises(ValueError, match=r"factored_rms.stats.emb.w.row \(8,\) belongs to the sharded param 'emb.w'"):
        parallel.state_specs(state, specs)


def test_shard_places_a_copy():
    mesh = parallel.make_mesh(1, 1)
    tree = {"w": jnp.arange(6.0).reshape(2, 3)}
    placed = parallel.shard(tree, {"w": P(None, MODEL)}, mesh)
    jax.jit(lambda t: t, donate_argnums=0)(placed)
    assert not tree["w"].is_deleted()  # donating the placed tree leaves the caller's array alone
    np.testing.assert_array_equal(tree["w"], np.arange(6.0).reshape(2, 3))


def _paths(tree):
    from purejax.tree import path_to_str

    return [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
