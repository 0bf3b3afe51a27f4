"""purejax.optim.base: chain (named states, mixing with optax both ways), apply_updates, safe_increment."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim
from purejax import tree as tree_lib


def test_chain_names_state_paths_by_the_given_names():
    params = {"blocks": {"attn": {"qkv": {"w": jnp.ones((2, 3))}}}}
    tx = optim.chain(
        clip=optim.clip_by_global_norm(1.0), adam=optim.scale_by_adam(), lr=optim.scale_by_learning_rate(0.1)
    )
    paths = list(tree_lib.flatten(tx.init(params)))
    assert "adam.mu.blocks.attn.qkv.w" in paths and "adam.nu.blocks.attn.qkv.w" in paths
    assert set(paths) == {
        "clip.global_norm",
        "adam.count",
        "adam.mu.blocks.attn.qkv.w",
        "adam.nu.blocks.attn.qkv.w",
        "lr.learning_rate",
    }


def test_positional_parts_are_named_by_index_and_run_first():
    tx = optim.chain(
        optax.scale(2.0),
        optim.identity(),
        last=optim.stateless(lambda u, p: jax.tree_util.tree_map(lambda x: x + 1, u)),
    )
    state = tx.init({"a": jnp.zeros(2)})
    assert set(state) == {"0", "1", "last"}
    updates, _ = tx.update({"a": jnp.ones(2)}, state)
    np.testing.assert_array_equal(updates["a"], [3.0, 3.0])  # scaled first, then +1


def test_chain_errors_name_the_part():
    with pytest.raises(ValueError, match="two parts named '0'"):
        optim.chain(optim.identity(), **{"0": optim.identity()})
    with pytest.raises(ValueError, match="'a.b'.*no '.'"):
        optim.chain(**{"a.b": optim.identity()})
    with pytest.raises(TypeError, match="'adam' is a function.*forget to call it"):
        optim.chain(adam=optim.scale_by_adam)
    with pytest.raises(TypeError, match="'lr' is a float"):
        optim.chain(lr=0.1)


def test_chain_rejects_a_state_from_another_chain():
    params = {"w": jnp.ones(3)}
    state = optim.adam(0.1).init(params)
    with pytest.raises(
        ValueError, match=r"chain state has parts \['adam', 'lr'\] but the chain has \['adam', 'weight_decay', 'lr'\]"
    ):
        optim.adamw(0.1).update(params, state, params)


def test_chain_state_survives_jit_which_reorders_dict_keys():
    params = {"w": jnp.ones(3)}
    tx = optim.chain(lr=optim.scale_by_learning_rate(0.1), adam=optim.scale_by_adam())  # not sorted
    state = jax.jit(tx.init)(params)
    updates, state = jax.jit(tx.update)(params, state, params)
    assert set(state) == {"lr", "adam"} and int(state["adam"].count) == 1


@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 1e-1), max_norm=st.floats(0.1, 10.0))
def test_purejax_chain_with_optax_parts_matches_optax(parity, lr, max_norm):
    parity(_ours_with_optax_parts, _optax_adam_clipped, {"lr": lr, "max_norm": max_norm})


@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 1e-1), max_norm=st.floats(0.1, 10.0))
def test_optax_chain_with_purejax_parts_matches_optax(parity, lr, max_norm):
    parity(_optax_with_purejax_parts, _optax_adam_clipped, {"lr": lr, "max_norm": max_norm})


def _ours_with_optax_parts(lr, max_norm):
    return optim.chain(
        optax.clip_by_global_norm(max_norm), adam=optim.scale_by_adam(), lr=optax.scale_by_learning_rate(lr)
    )


def _optax_with_purejax_parts(lr, max_norm):
    return optax.chain(optim.clip_by_global_norm(max_norm), optim.scale_by_adam(), optim.scale_by_learning_rate(lr))


def _optax_adam_clipped(lr, max_norm):
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(lr))


def test_apply_updates_keeps_each_parameter_dtype():
    params = {"w": jnp.ones(3, jnp.float32), "h": jnp.ones(3, jnp.bfloat16)}
    updates = {"w": jnp.full(3, 0.5, jnp.bfloat16), "h": jnp.full(3, 0.5, jnp.float32)}
    new = optim.apply_updates(params, updates)
    assert new["w"].dtype == jnp.float32 and new["h"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(new["w"], 1.5)


def test_apply_updates_reports_every_mismatched_path():
    params = {"a": jnp.ones(2), "b": {"c": jnp.ones(2)}}
    with pytest.raises(tree_lib.TreeMismatchError, match=r"(?s)missing:\s+b\.c.*unexpected:\s+b\.d"):
        optim.apply_updates(params, {"a": jnp.ones(2), "b": {"d": jnp.ones(2)}})


def test_safe_increment_saturates_instead_of_wrapping():
    top = jnp.iinfo(jnp.int32).max
    assert int(optim.safe_increment(jnp.asarray(top, jnp.int32))) == top
    assert int(optim.safe_increment(jnp.asarray(41, jnp.int32))) == 42


def test_bias_correction_matches_float64():
    m = {"a": jnp.asarray([1.0, -2.0])}
    got = optim.bias_correction(m, 0.9, jnp.asarray(3, jnp.int32))
    np.testing.assert_allclose(got["a"], np.array([1.0, -2.0]) / (1 - 0.9**3), rtol=1e-6)
