"""purejax.optim.weight_decay: decoupled weight decay and its masks (trees and predicates), and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import optim
from purejax import tree as tree_lib

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
