"""purejax.optim.sgd: SGD with momentum and Nesterov momentum against optax.sgd, and the momentum buffer."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim


def _ours_plain(lr, momentum):
    return optim.sgd(lr)


def _optax_plain(lr, momentum):
    return optax.sgd(lr)


def _ours_heavy_ball(lr, momentum):
    return optim.sgd(lr, momentum)


def _optax_heavy_ball(lr, momentum):
    return optax.sgd(lr, momentum)


def _ours_nesterov(lr, momentum):
    return optim.sgd(lr, momentum, nesterov=True)


def _optax_nesterov(lr, momentum):
    return optax.sgd(lr, momentum, nesterov=True)


@pytest.mark.parametrize(
    "ours, theirs",
    [(_ours_plain, _optax_plain), (_ours_heavy_ball, _optax_heavy_ball), (_ours_nesterov, _optax_nesterov)],
    ids=["plain", "momentum", "nesterov"],
)
@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 0.5), momentum=st.floats(0.0, 0.99))
def test_sgd_matches_optax_over_100_steps(parity, ours, theirs, lr, momentum):
    parity(ours, theirs, {"lr": lr, "momentum": momentum})


def test_momentum_buffer_follows_torch_recurrence():
    """torch.optim.SGD without dampening: buf = momentum * buf + g; nesterov step: g + momentum * buf."""
    tx = optim.trace(0.9, nesterov=True)
    state = tx.init({"w": jnp.zeros(2)})
    buf = np.zeros(2)
    for g in ([1.0, -1.0], [0.5, 2.0], [-3.0, 0.25]):
        updates, state = tx.update({"w": jnp.asarray(g)}, state)
        buf = 0.9 * buf + np.asarray(g)
        np.testing.assert_allclose(state.trace["w"], buf, rtol=1e-6)
        np.testing.assert_allclose(updates["w"], np.asarray(g) + 0.9 * buf, rtol=1e-6)


def test_momentum_buffer_dtype_can_be_chosen():
    state = optim.trace(0.9, accumulator_dtype=jnp.bfloat16).init({"w": jnp.zeros(3)})
    _, state = optim.trace(0.9, accumulator_dtype=jnp.bfloat16).update({"w": jnp.ones(3)}, state)
    assert state.trace["w"].dtype == jnp.bfloat16


def _ours_bf16_buffer(lr, momentum):
    return optim.sgd(lr, momentum, nesterov=True, accumulator_dtype=jnp.bfloat16)


def _optax_bf16_buffer(lr, momentum):
    return optax.sgd(lr, momentum, nesterov=True, accumulator_dtype=jnp.bfloat16)


def test_sgd_accumulator_dtype_matches_optax(parity):
    """A bfloat16 momentum buffer: the same rounding as optax's at every step (bit for bit in practice)."""
    parity(_ours_bf16_buffer, _optax_bf16_buffer, {"lr": 0.05, "momentum": 0.9})
    state = _ours_bf16_buffer(0.05, 0.9).init({"w": jnp.zeros(3)})
    assert state["momentum"].trace["w"].dtype == jnp.bfloat16


def test_sgd_state_is_named():
    state = optim.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(3)})
    assert set(state) == {"momentum", "lr"} and isinstance(state["momentum"], optim.TraceState)


def test_nesterov_or_a_buffer_dtype_without_momentum_is_an_error():
    for options in ({"nesterov": True}, {"accumulator_dtype": jnp.bfloat16}):
        with pytest.raises(ValueError, match="apply to the momentum buffer: give a momentum value"):
            optim.sgd(0.1, **options)
