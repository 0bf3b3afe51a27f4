"""purejax.optim.lion: Lion against optax.lion over 100 steps, and the sign update itself."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim


def _ours(lr, b1, b2, wd):
    return optim.lion(lr, b1, b2, weight_decay=wd, mask=optim.ndim_at_least(2))


def _theirs(lr, b1, b2, wd):
    return optax.lion(
        lr, b1, b2, weight_decay=wd, mask=lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    )


@settings(max_examples=15, deadline=None)
@given(lr=st.floats(1e-5, 1e-2), b1=st.floats(0.0, 0.99), b2=st.floats(0.9, 0.999), wd=st.floats(0.0, 1.0))
def test_lion_matches_optax_over_100_steps(parity, lr, b1, b2, wd):
    parity(_ours, _theirs, dict(lr=lr, b1=b1, b2=b2, wd=wd))


def test_lion_update_is_the_sign_of_the_interpolation_and_momentum_uses_b2():
    tx = optim.scale_by_lion(b1=0.9, b2=0.99)
    state = tx.init({"w": jnp.zeros(3)})
    state = state._replace(mu={"w": jnp.asarray([1.0, -1.0, 0.0])})
    g = np.array([-5.0, 5.0, -2.0])
    updates, state = tx.update({"w": jnp.asarray(g)}, state)
    np.testing.assert_array_equal(updates["w"], np.sign(0.1 * g + 0.9 * np.array([1.0, -1.0, 0.0])))
    np.testing.assert_allclose(state.mu["w"], 0.01 * g + 0.99 * np.array([1.0, -1.0, 0.0]), rtol=1e-6)
    assert int(state.count) == 1
