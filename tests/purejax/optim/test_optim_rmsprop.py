"""purejax.optim.rmsprop: RMSprop (plain, centered, eps outside the root, with momentum) against optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim

VARIANTS = {
    "plain": dict(),
    "centered": dict(centered=True),
    "eps-outside-sqrt": dict(eps_in_sqrt=False, initial_scale=1.0),
    "momentum": dict(momentum=0.9),
    "centered-nesterov": dict(centered=True, momentum=0.8, nesterov=True),
    "bias-correction": dict(bias_correction=True, eps_in_sqrt=False),
    # initial_scale 1: started at 0, the first step's variance nu_hat - mu_hat**2 is g**2 - g**2 = 0 (NaN in optax too)
    "centered-bias-correction": dict(centered=True, bias_correction=True, momentum=0.9, initial_scale=1.0),
}


def _builder(rmsprop, options):
    """A (lr, decay, eps) -> optimizer function for one variant, for the parity runner."""
    return lambda lr, decay, eps: rmsprop(lr, decay, eps, **options)


_OURS = {name: _builder(optim.rmsprop, options) for name, options in VARIANTS.items()}
_THEIRS = {name: _builder(optax.rmsprop, options) for name, options in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 1e-1), decay=st.floats(0.5, 0.999), eps=st.floats(1e-8, 1e-2))
def test_rmsprop_matches_optax_over_100_steps(parity, variant, lr, decay, eps):
    parity(_OURS[variant], _THEIRS[variant], dict(lr=lr, decay=decay, eps=eps))


def test_centered_rms_divides_by_the_running_standard_deviation():
    tx = optim.scale_by_rms(decay=0.5, eps=0.0, centered=True)
    state = tx.init({"w": jnp.zeros(1)})
    mu = nu = 0.0
    for g in (1.0, 3.0, -2.0):
        updates, state = tx.update({"w": jnp.asarray([g])}, state)
        mu, nu = 0.5 * mu + 0.5 * g, 0.5 * nu + 0.5 * g * g
        np.testing.assert_allclose(updates["w"], [g / np.sqrt(nu - mu * mu)], rtol=1e-6)
    assert isinstance(state, optim.CenteredRmsState)


def test_nesterov_without_momentum_is_an_error():
    with pytest.raises(ValueError, match="needs a momentum"):
        optim.rmsprop(0.1, nesterov=True)


def test_the_state_keeps_its_dtype_with_wider_gradients():
    """bfloat16 params, float32 gradients (what a loss scale's unscale gives): the state stays bfloat16, so a
    jitted step does not retrace and multi_steps' cond branches agree."""
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    for tx in (optim.rmsprop(0.1), optim.rmsprop(0.1, centered=True)):
        state = tx.init(params)
        _, new = tx.update({"w": jnp.full(3, 0.5, jnp.float32)}, state, params)
        assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
        k_steps = optim.multi_steps(tx, 2)
        k_steps.update({"w": jnp.full(3, 0.5, jnp.float32)}, k_steps.init(params), params)  # raised before


def test_bias_corrected_rms_is_adam_without_a_first_moment(parity):
    """optax's note: scale_by_rms(b2, eps_in_sqrt=False, bias_correction=True) is scale_by_adam(b1=0, b2)."""
    ours = lambda lr, b2: optim.chain(  # noqa: E731
        rms=optim.scale_by_rms(b2, 1e-8, eps_in_sqrt=False, bias_correction=True), lr=optim.scale_by_learning_rate(lr)
    )
    parity(ours, lambda lr, b2: optax.adam(lr, b1=0.0, b2=b2), {"lr": 1e-2, "b2": 0.99})
    state = optim.rmsprop(0.1, bias_correction=True).init({"w": jnp.zeros(3)})
    assert int(state["rms"].count) == 0 and optim.rmsprop(0.1).init({"w": jnp.zeros(3)})["rms"].count is None
