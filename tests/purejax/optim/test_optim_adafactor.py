"""purejax.optim.adafactor: Adafactor against optax.adafactor over 100 steps (factored and unfactored leaves,
momentum, weight decay), the factored state layout and its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim
from purejax import tree as tree_lib
from purejax.optim.adafactor import factored_axes


# min_dim_size_to_factor=3 factors w (6, 4), blocks.*.w (3, 5)/(5, 3) and conv (2, 3, 4) along its two largest
# axes, and leaves the vectors and scalars unfactored.
def _ours(lr, decay_rate):
    return optim.adafactor(lr, min_dim_size_to_factor=3, decay_rate=decay_rate)


def _theirs(lr, decay_rate):
    return optax.adafactor(lr, min_dim_size_to_factor=3, decay_rate=decay_rate)


def _ours_full(lr, decay_rate):
    return optim.adafactor(
        lr,
        min_dim_size_to_factor=3,
        decay_rate=decay_rate,
        momentum=0.9,
        weight_decay_rate=1e-3,
        weight_decay_mask=optim.ndim_at_least(2),
        clipping_threshold=None,
    )


def _theirs_full(lr, decay_rate):
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=3,
        decay_rate=decay_rate,
        momentum=0.9,
        weight_decay_rate=1e-3,
        weight_decay_mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p),
        clipping_threshold=None,
    )


def _ours_unfactored(lr, decay_rate):
    return optim.adafactor(lr, factored=False, multiply_by_parameter_scale=False)


def _theirs_unfactored(lr, decay_rate):
    return optax.adafactor(lr, factored=False, multiply_by_parameter_scale=False)


@pytest.mark.parametrize(
    "ours, theirs",
    [(_ours, _theirs), (_ours_full, _theirs_full), (_ours_unfactored, _theirs_unfactored)],
    ids=["defaults", "momentum-weight-decay-no-clipping", "unfactored"],
)
@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-3, 1e-1), decay_rate=st.floats(0.5, 1.0))
def test_adafactor_matches_optax_over_100_steps(parity, ours, theirs, lr, decay_rate):
    parity(ours, theirs, dict(lr=lr, decay_rate=decay_rate))


def test_factored_state_has_row_and_column_statistics_named_by_parameter(sample_params):
    params = sample_params
    state = optim.adafactor(1e-2, min_dim_size_to_factor=3).init(params)
    flat = {p: x.shape for p, x in tree_lib.flatten(state).items()}
    assert flat["factored_rms.stats.w.row"] == (6,) and flat["factored_rms.stats.w.col"] == (4,)
    assert flat["factored_rms.stats.blocks.0.w.row"] == (3,) and flat["factored_rms.stats.blocks.0.w.col"] == (5,)
    assert flat["factored_rms.stats.blocks.1.w.row"] == (5,) and flat["factored_rms.stats.blocks.1.w.col"] == (3,)
    assert flat["factored_rms.stats.conv.row"] == (2, 3) and flat["factored_rms.stats.conv.col"] == (2, 4)  # axes 1, 2
    assert flat["factored_rms.stats.b.v"] == (4,)


def test_factored_state_is_sublinear_on_a_large_matrix():
    params = {"w": jnp.zeros((768, 3072))}
    state = jax.eval_shape(optim.adafactor(1e-2).init, params)
    assert tree_lib.count(state) == 768 + 3072 + 2  # the statistics, the step count, the learning rate


def test_factored_estimate_is_the_rank_one_outer_product():
    """After one step from zero state with decay 0, the preconditioner is outer(row, col) / mean(row)."""
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 6)).astype(np.float32)
    tx = optim.scale_by_factored_rms(min_dim_size_to_factor=2, decay_rate=0.0, eps=0.0)  # decay_t = 1 - 1 = 0
    updates, state = tx.update({"g": jnp.asarray(g)}, tx.init({"g": jnp.zeros((4, 6))}))
    row, col = (g**2).mean(axis=1), (g**2).mean(axis=0)
    v_hat = np.outer(row, col) / row.mean()
    np.testing.assert_allclose(updates["g"], g / np.sqrt(v_hat), rtol=1e-5)
    np.testing.assert_allclose(state.stats["g"].row, row, rtol=1e-6)


def test_factored_axes_picks_the_two_largest():
    assert factored_axes((768, 3072), 128) == (0, 1)
    assert factored_axes((3072, 768), 128) == (1, 0)
    assert factored_axes((8, 768, 3072), 128) == (1, 2)
    assert factored_axes((100, 3072), 128) is None
    assert factored_axes((3072,), 128) is None
