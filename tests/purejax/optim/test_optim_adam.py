"""purejax.optim.adam: Adam and AdamW (with masks) against optax over 100 steps, state layout and dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim
from purejax import tree as tree_lib

ADAM_HPARAMS = dict(
    lr=st.floats(1e-4, 1e-1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.9, 0.9999),
    eps=st.floats(1e-8, 1e-3),
    eps_root=st.sampled_from([0.0, 1e-8]),
)


def _ours_adam(lr, b1, b2, eps, eps_root):
    return optim.adam(lr, b1, b2, eps, eps_root)


def _optax_adam(lr, b1, b2, eps, eps_root):
    return optax.adam(lr, b1, b2, eps, eps_root)


@settings(max_examples=15, deadline=None)
@given(**ADAM_HPARAMS)
def test_adam_matches_optax_over_100_steps(parity, lr, b1, b2, eps, eps_root):
    parity(_ours_adam, _optax_adam, dict(lr=lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root))


def _ndim2(path, p):
    return p.ndim >= 2


def _ours_adamw_predicate(lr, b1, b2, eps, wd):
    return optim.adamw(lr, b1, b2, eps, weight_decay=wd, mask=_ndim2)


def _ours_adamw_tree(lr, b1, b2, eps, wd):
    mask = {"w": True, "b": False, "blocks": [{"w": True, "scale": False}, {"w": False, "scale": True}], "conv": True}
    return optim.adamw(lr, b1, b2, eps, weight_decay=wd, mask=mask)


def _optax_adamw_ndim2(lr, b1, b2, eps, wd):
    return optax.adamw(
        lr, b1, b2, eps, weight_decay=wd, mask=lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    )


def _optax_adamw_tree(lr, b1, b2, eps, wd):
    mask = {"w": True, "b": False, "blocks": [{"w": True, "scale": False}, {"w": False, "scale": True}], "conv": True}
    return optax.adamw(lr, b1, b2, eps, weight_decay=wd, mask=mask)


def _ours_adamw_all(lr, b1, b2, eps, wd):
    return optim.adamw(lr, b1, b2, eps, weight_decay=wd)


def _optax_adamw_all(lr, b1, b2, eps, wd):
    return optax.adamw(lr, b1, b2, eps, weight_decay=wd)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (_ours_adamw_all, _optax_adamw_all),
        (_ours_adamw_predicate, _optax_adamw_ndim2),
        (_ours_adamw_tree, _optax_adamw_tree),
    ],
    ids=["no-mask", "predicate-mask", "tree-mask"],
)
@settings(max_examples=10, deadline=None)
@given(
    lr=ADAM_HPARAMS["lr"], b1=ADAM_HPARAMS["b1"], b2=ADAM_HPARAMS["b2"], eps=ADAM_HPARAMS["eps"], wd=st.floats(0.0, 0.5)
)
def test_adamw_matches_optax_over_100_steps(parity, ours, theirs, lr, b1, b2, eps, wd):
    parity(ours, theirs, dict(lr=lr, b1=b1, b2=b2, eps=eps, wd=wd))


def _ours_nadam(lr, b1, b2, eps, eps_root):
    return optim.adam(lr, b1, b2, eps, eps_root, nesterov=True)


def _optax_nadam(lr, b1, b2, eps, eps_root):
    return optax.adam(lr, b1, b2, eps, eps_root, nesterov=True)


@settings(max_examples=10, deadline=None)
@given(**ADAM_HPARAMS)
def test_adam_with_nesterov_matches_optax_nadam(parity, lr, b1, b2, eps, eps_root):
    parity(_ours_nadam, _optax_nadam, dict(lr=lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root))


def _ours_nadamw(lr, wd):
    return optim.adamw(lr, weight_decay=wd, mask=optim.ndim_at_least(2), nesterov=True)


def _optax_nadamw(lr, wd):
    return optax.adamw(lr, weight_decay=wd, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), nesterov=True)


def test_adamw_with_nesterov_matches_optax(parity):
    parity(_ours_nadamw, _optax_nadamw, {"lr": 1e-2, "wd": 0.1})


def test_nesterov_changes_the_first_update_as_nadam_says():
    """Step 1 (Dozat 2016, optax's form): mu_hat = b1 * mu / (1 - b1**2) + (1 - b1) * g / (1 - b1) with
    mu = (1 - b1) * g, i.e. g * (b1 / (1 + b1) + 1); nu_hat = g**2. In float64."""
    g = np.array([0.3, -2.0, 1e-3])
    tx = optim.adam(0.1, nesterov=True)
    updates, _ = tx.update({"w": jnp.asarray(g, jnp.float32)}, tx.init({"w": jnp.zeros(3)}))
    mu_hat = g * (0.9 / 1.9 + 1)
    np.testing.assert_allclose(updates["w"], -0.1 * mu_hat / (np.abs(g) + 1e-8), rtol=1e-5)


def _ours_adam_bf16_mu(lr):
    return optim.adam(lr, mu_dtype=jnp.bfloat16)


def _optax_adam_bf16_mu(lr):
    return optax.adam(lr, mu_dtype=jnp.bfloat16)


def test_adam_with_bfloat16_first_moment_matches_optax(parity):
    parity(_ours_adam_bf16_mu, _optax_adam_bf16_mu, {"lr": 1e-2})
    state = _ours_adam_bf16_mu(1e-2).init({"w": jnp.zeros(3)})
    assert state["adam"].mu["w"].dtype == jnp.bfloat16 and state["adam"].nu["w"].dtype == jnp.float32


def test_adam_first_update_is_lr_times_sign_of_gradient():
    """After one step mu_hat = g and nu_hat = g**2, so the update is -lr * g / (|g| + eps) (Kingma & Ba, sec. 2)."""
    g = np.array([0.3, -2.0, 1e-3])
    updates, _ = optim.adam(0.1).update({"w": jnp.asarray(g)}, optim.adam(0.1).init({"w": jnp.zeros(3)}))
    # rtol 1e-5: 1 - b2 is rounded from float64 but 1 - b2**t is computed in float32 (as in optax), ~7e-6 apart.
    np.testing.assert_allclose(updates["w"], -0.1 * g / (np.abs(g) + 1e-8), rtol=1e-5)


def test_adamw_state_paths_hold_only_the_two_moments_per_parameter():
    params = {"blocks": {"attn": {"qkv": {"w": jnp.zeros((4, 12))}}}, "ln": {"g": jnp.ones(4)}}
    state = optim.adamw(1e-3, mask=optim.ndim_at_least(2)).init(params)
    flat = tree_lib.flatten(state)
    assert set(flat) == {
        "adam.count",
        "adam.mu.blocks.attn.qkv.w",
        "adam.mu.ln.g",
        "adam.nu.blocks.attn.qkv.w",
        "adam.nu.ln.g",
        "lr.learning_rate",
    }
    assert tree_lib.count(state) == 2 * tree_lib.count(params) + 2
