"""purejax.nn.serial: a chain equals the layers composed by hand; params under stable names (inserting a step
changes no other layer's path or initial value); a random step gets fold_in(key, i), none without a key;
errors name the names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import random as prandom
from purejax.nn import dropout, linear, serial

X = jax.random.normal(jax.random.key(0), (5, 3))
FC1 = serial.layer("fc1", lambda key: linear.init(key, 3, 4), linear.apply)
RELU = serial.function(jax.nn.relu)
FC2 = serial.layer("fc2", lambda key: linear.init(key, 4, 2), linear.apply)
DROP = serial.function(lambda x, key: dropout.apply(x, rate=0.5, key=key), random=True)


def test_a_chain_is_its_layers_composed_by_hand():
    key = jax.random.key(1)
    params = serial.init(key, [FC1, RELU, FC2])
    keys = prandom.named_keys(key, "fc1", "fc2")
    fc1, fc2 = linear.init(keys["fc1"], 3, 4), linear.init(keys["fc2"], 4, 2)
    np.testing.assert_array_equal(params["fc1"]["w"], fc1["w"])
    by_hand = linear.apply(fc2, jax.nn.relu(linear.apply(fc1, X)))
    np.testing.assert_array_equal(serial.apply(params, X, [FC1, RELU, FC2]), by_hand)


def test_inserting_a_step_keeps_the_other_layers_paths_and_values():
    key = jax.random.key(2)
    before = serial.init(key, [FC1, FC2])
    after = serial.init(
        key, [FC1, RELU, DROP, serial.layer("fc_mid", lambda k: linear.init(k, 4, 4), linear.apply), FC2]
    )
    for name in ("fc1", "fc2"):
        np.testing.assert_array_equal(before[name]["w"], after[name]["w"])


def test_a_random_step_draws_with_its_own_key_and_not_without_one():
    steps = [FC1, DROP, FC2]
    params = serial.init(jax.random.key(3), steps)
    key = jax.random.key(4)
    dropped = serial.apply(params, X, steps, key=key)
    by_hand = linear.apply(
        params["fc2"], dropout.apply(linear.apply(params["fc1"], X), rate=0.5, key=jax.random.fold_in(key, 1))
    )
    np.testing.assert_array_equal(dropped, by_hand)
    evaluated = serial.apply(params, X, steps)
    np.testing.assert_allclose(evaluated, linear.apply(params["fc2"], linear.apply(params["fc1"], X)), rtol=1e-6)
    assert not jnp.allclose(dropped, evaluated)


def test_a_chain_trains_under_jit_and_grad():
    steps = [FC1, RELU, FC2]
    params = serial.init(jax.random.key(5), steps)
    y = jnp.array([0, 1, 1, 0, 1])

    def loss(params):
        logits = serial.apply(params, X, steps)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(5), y])

    grads = jax.jit(jax.grad(loss))(params)
    assert set(grads) == {"fc1", "fc2"} and grads["fc1"]["w"].shape == (3, 4)
    step = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert loss(step) < loss(params)


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"\['fc1'\] are used twice"):
        serial.init(jax.random.key(0), [FC1, FC1])
    with pytest.raises(ValueError, match=r"params hold \['fc1'\], but the steps' layers are \['fc1', 'fc2'\]"):
        serial.apply({"fc1": {}}, X, [FC1, FC2])
    with pytest.raises(TypeError, match="steps"):  # the run-time type checker or serial's own check
        serial.init(jax.random.key(0), [linear.apply])
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        serial.layer("", lambda key: {}, linear.apply)
