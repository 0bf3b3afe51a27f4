"""purejax.optim.weight_decay: decoupled weight decay and its masks (trees and predicates), and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import optim
from purejax import tree as tree_lib
from purejax.nn import layer_norm, linear, stack

PARAMS = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((3,), 2.0), "ln": {"g": jnp.full((3,), 2.0)}}


def test_decay_is_added_only_where_the_predicate_selects():
    tx = optim.add_decayed_weights(0.1, mask=optim.ndim_at_least(2))
    grads = {"w": jnp.ones((2, 3)), "b": jnp.ones(3), "ln": {"g": jnp.ones(3)}}
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(updates["w"], 1.0 + 0.1 * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], 1.0)
    np.testing.assert_array_equal(updates["ln"]["g"], 1.0)


def test_predicate_sees_dotted_paths():
    seen = []
    optim.resolve_mask(lambda path, p: seen.append(path) or True, PARAMS)
    assert sorted(seen) == ["b", "ln.g", "w"]


def test_mask_tree_matches_the_predicate_result():
    by_tree = optim.resolve_mask({"w": True, "b": False, "ln": {"g": False}}, PARAMS)
    by_rule = optim.resolve_mask(optim.ndim_at_least(2), PARAMS)
    assert by_tree == by_rule == {"w": True, "b": False, "ln": {"g": False}}


def test_mask_tree_with_missing_and_extra_paths_reports_both():
    with pytest.raises(tree_lib.TreeMismatchError, match=r"(?s)missing:\s+ln\.g.*unexpected:\s+ln\.beta"):
        optim.resolve_mask({"w": True, "b": False, "ln": {"beta": False}}, PARAMS)


def test_mask_that_tests_array_values_is_refused_with_the_path():
    with pytest.raises(TypeError, match=r"Python bool.*b \(ArrayImpl\), ln\.g \(ArrayImpl\), w \(ArrayImpl\)"):
        optim.resolve_mask(lambda path, p: jnp.all(p > 0), PARAMS)


def test_an_optax_style_mask_function_is_explained():
    with pytest.raises(TypeError, match=r"called as mask\(path, leaf\) .* not as optax's mask\(params\)"):
        optim.resolve_mask(lambda params: jax.tree.map(lambda p: p.ndim >= 2, params), PARAMS)


def test_decay_without_params_says_what_to_pass():
    tx = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(PARAMS, tx.init(PARAMS))


def _block(key):
    return {"ln": layer_norm.init(None, 4), "fc": linear.init(key, 4, 8)}


def test_stacked_blocks_are_masked_as_their_unstacked_layers():
    """Blocks stacked for lax.scan carry a leading layer axis: their LayerNorm scales are 2-D there. With
    `stacked=`, the mask of the stacked tree is the mask of every unstacked layer under `ndim_at_least(2)`."""
    key = jax.random.key(0)
    params = {"wte": jnp.zeros((10, 4)), "ln_f": layer_norm.init(None, 4), "blocks": stack.init(key, 3, _block)}
    mask = optim.resolve_mask(optim.ndim_at_least(2, stacked=("blocks",)), params)
    per_layer = [optim.resolve_mask(optim.ndim_at_least(2), layer) for layer in stack.unstack(params["blocks"])]
    assert all(layer == mask["blocks"] for layer in per_layer)
    assert mask["blocks"] == {"ln": {"scale": False, "bias": False}, "fc": {"w": True, "b": False}}
    assert mask["wte"] and not mask["ln_f"]["scale"]
    naive = optim.resolve_mask(optim.ndim_at_least(2), params)  # the trap: stacked LayerNorm scales decay
    assert naive["blocks"]["ln"]["scale"]


def test_a_stacked_prefix_on_a_scalar_is_refused_with_its_path():
    with pytest.raises(ValueError, match=r"ndim_at_least\(stacked=\('ln',\)\): ln\.g has shape \(\), so it has no"):
        optim.resolve_mask(optim.ndim_at_least(2, stacked=("ln",)), {"ln": {"g": jnp.zeros(())}})
