"""purejax.optim.loss_scale: the dynamic loss scale against jmp's adjust semantics, and the fields jmp loses."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim


@jax.jit
def run_both(finite_flags, ours, theirs):
    def body(scales, finite):
        a, b = scales
        a, b = a.adjust(finite), b.adjust(finite)
        return (a, b), (a.loss_scale, a.counter, b.loss_scale, b.counter)

    return jax.lax.scan(body, (ours, theirs), finite_flags)[1]


@settings(max_examples=15, deadline=None)
@given(
    flags=st.lists(st.booleans() | st.just(True), min_size=120, max_size=120),
    period=st.sampled_from([1, 2, 5]),  # jmp keeps period and factor static: each pair compiles anew
    factor=st.sampled_from([2, 4]),  # powers of two, as used in practice: scaling by them is exact
    log2_initial=st.integers(0, 24),
)
def test_dynamic_adjust_matches_jmp_over_120_steps(flags, period, factor, log2_initial):
    ours = optim.dynamic_loss_scale(2.0**log2_initial, period, factor)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**log2_initial), period=period, factor=factor)
    ours_scale, ours_counter, jmp_scale, jmp_counter = run_both(jnp.asarray(flags), ours, theirs)
    np.testing.assert_array_equal(ours_scale, jmp_scale)
    np.testing.assert_array_equal(ours_counter, jmp_counter)


def test_scale_and_unscale_match_jmp():
    ours, theirs = optim.dynamic_loss_scale(2.0**12), jmp.DynamicLossScale(jnp.float32(2.0**12))
    tree = {"loss": jnp.float16(1.5), "g": jnp.asarray([3.0, -7.0], jnp.float32)}
    for got, want in ((ours.scale(tree), theirs.scale(tree)), (ours.unscale(tree), theirs.unscale(tree))):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert a.dtype == b.dtype  # float16 is promoted to the scale's float32, as in jmp
            np.testing.assert_array_equal(a, b)


def test_overflow_halves_and_growth_waits_for_the_period():
    scale = optim.dynamic_loss_scale(2.0**10, period=3, factor=2.0)
    scale = scale.adjust(jnp.asarray(False))
    assert float(scale.loss_scale) == 2.0**9 and int(scale.counter) == 0
    for _ in range(2):
        scale = scale.adjust(jnp.asarray(True))
    assert float(scale.loss_scale) == 2.0**9 and int(scale.counter) == 2
    scale = scale.adjust(jnp.asarray(True))
    assert float(scale.loss_scale) == 2.0**10 and int(scale.counter) == 0


def test_minimum_is_respected_through_jit_and_tree_operations():
    """jmp's DynamicLossScale keeps min_loss_scale out of its pytree and silently resets it to 1 under jit."""
    scale = optim.dynamic_loss_scale(2.0**12, min_loss_scale=2.0**10)
    scale = jax.tree_util.tree_map(lambda x: x, scale)  # a tree operation keeps every field
    overflows = jnp.zeros(20, bool)
    scales = jax.jit(lambda s, f: jax.lax.scan(lambda s, x: (s.adjust(x), s.adjust(x).loss_scale), s, f))(
        scale, overflows
    )[1]
    assert float(jnp.min(scales)) == 2.0**10
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    assert len(leaves) == 5 and float(jax.tree_util.tree_unflatten(treedef, leaves).min_loss_scale) == 2.0**10


def test_growth_never_overflows_float32():
    scale = optim.dynamic_loss_scale(2.0**127, period=1).adjust(jnp.asarray(True))
    assert float(scale.loss_scale) == 2.0**127


def test_static_and_no_scale_keep_their_value():
    static = optim.static_loss_scale(128.0)
    assert float(static.adjust(jnp.asarray(False)).loss_scale) == 128.0
    assert float(static.scale(jnp.float32(2.0))) == 256.0 and float(static.unscale(jnp.float32(256.0))) == 2.0
    none = optim.NoLossScale()
    assert none.scale(3.0) == 3.0 and none.adjust(jnp.asarray(False)) is none and float(none.loss_scale) == 1.0


def test_bad_dynamic_settings_are_named():
    with pytest.raises(ValueError, match="initial >= min_loss_scale > 0.*factor=1"):
        optim.dynamic_loss_scale(2.0**15, factor=1)


def test_all_finite_matches_numpy():
    assert bool(optim.all_finite({"a": jnp.ones(3), "b": jnp.asarray([1.0, jnp.inf])})) is False
    assert bool(optim.all_finite({"a": jnp.ones(3), "b": jnp.asarray([jnp.nan])})) is False
    assert bool(optim.all_finite({"a": jnp.ones(3)})) is True and bool(optim.all_finite({})) is True


def test_all_finite_with_axis_name_agrees_across_shards():
    shards = {"g": jnp.asarray([[1.0, 2.0], [3.0, jnp.inf], [5.0, 6.0]])}  # 3 emulated devices, one overflowed
    local = jax.vmap(lambda s: optim.all_finite(s))(shards)
    everywhere = jax.vmap(lambda s: optim.all_finite(s, axis_name="d"), axis_name="d")(shards)
    np.testing.assert_array_equal(local, [True, False, True])
    np.testing.assert_array_equal(everywhere, [False, False, False])
