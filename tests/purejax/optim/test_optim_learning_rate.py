"""purejax.optim.learning_rate: the rate in the optimizer state, readable and changeable without recompiling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import optim
from purejax.optim import schedules


def _ours_scheduled():
    return optim.adamw(schedules.warmup_cosine(1e-2, 10, 80, 1e-3, init_value=0.0), weight_decay=0.1)


def _optax_scheduled():
    return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 80, 1e-3), weight_decay=0.1)


def test_scheduled_adamw_matches_optax_over_100_steps(parity):
    parity(_ours_scheduled, _optax_scheduled, {})


def test_the_state_holds_the_rate_the_last_update_used():
    schedule = schedules.linear(1.0, 0.0, 10)
    tx = optim.sgd(schedule)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for step in range(4):
        updates, state = tx.update({"w": jnp.ones(2)}, state)
        np.testing.assert_allclose(optim.get_learning_rate(state), float(schedule(step)), rtol=1e-6)
        np.testing.assert_allclose(updates["w"], -float(schedule(step)), rtol=1e-6)


def test_set_learning_rate_changes_the_rate_without_recompiling():
    tx = optim.adam(1e-3)
    params = {"w": jnp.ones(3)}

    @jax.jit
    @chex.assert_max_traces(n=1)
    def update(state):
        return tx.update({"w": jnp.ones(3)}, state, params)

    state = tx.init(params)
    first, state = update(state)
    state = optim.set_learning_rate(state, 5e-3)
    second, state = update(state)
    assert float(optim.get_learning_rate(state)) == np.float32(5e-3)
    # Adam's direction is 1 for a constant gradient, so the update is -lr (up to the float32 bias corrections).
    np.testing.assert_allclose(first["w"], -1e-3, rtol=1e-4)
    np.testing.assert_allclose(second["w"], -5e-3, rtol=1e-4)


def test_setting_a_scheduled_rate_is_refused():
    state = optim.adam(schedules.constant(1e-3)).init({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="found no constant learning rate.*change the schedule"):
        optim.set_learning_rate(state, 1e-4)


def test_the_rate_is_found_in_an_optax_inject_hyperparams_state():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.25)
    state = tx.init({"w": jnp.ones(3)})
    assert float(optim.get_learning_rate(state)) == 0.25
    assert optim.get_learning_rate(optax.adam(0.1).init({"w": jnp.ones(3)})) is None


def test_flip_sign_off_scales_up():
    tx = optim.scale_by_learning_rate(0.5, flip_sign=False)
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(None))
    np.testing.assert_array_equal(updates["w"], 0.5)
