"""purejax.optim.clipping: clipping by global norm (optax, torch's formula, the norm in the state, sharded
leaves), by value and by block RMS."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim
from purejax import tree as tree_lib


def _ours(lr, max_norm):
    return optim.chain(clip=optim.clip_by_global_norm(max_norm), adamw=optim.adamw(lr, weight_decay=0.01))


def _theirs(lr, max_norm):
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(lr, weight_decay=0.01))


@settings(max_examples=15, deadline=None)
@given(lr=st.floats(1e-4, 1e-1), max_norm=st.floats(0.5, 20.0))  # random gradients here have norm ~9
def test_clipped_adamw_matches_optax_over_100_steps(parity, lr, max_norm):
    parity(_ours, _theirs, dict(lr=lr, max_norm=max_norm))


def _ours_value(lr, delta):
    return optim.chain(
        clip=optim.clip(delta), block=optim.clip_by_block_rms(delta), lr=optim.scale_by_learning_rate(lr)
    )


def _theirs_value(lr, delta):
    return optax.chain(optax.clip(delta), optax.clip_by_block_rms(delta), optax.sgd(lr))


@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-3, 1e-1), delta=st.floats(0.05, 3.0))
def test_clip_by_value_and_block_rms_match_optax_over_100_steps(parity, lr, delta):
    parity(_ours_value, _theirs_value, dict(lr=lr, delta=delta))


def test_global_norm_is_kept_in_the_state_and_matches_float64(sample_params):
    grads = jax.tree_util.tree_map(lambda p: 3.0 * p, sample_params)
    tx = optim.clip_by_global_norm(1.0)
    clipped, state = jax.jit(tx.update)(grads, tx.init(grads))
    want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree_util.tree_leaves(grads)))
    np.testing.assert_allclose(float(state.global_norm), want, rtol=1e-6)
    np.testing.assert_allclose(float(tree_lib.global_norm(clipped)), 1.0, rtol=1e-6)


def test_matches_torch_clip_grad_norm_formula_to_1e_6():
    """torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), applied when coef < 1."""
    g = np.random.default_rng(0).normal(size=(50,)) * 10
    total = np.linalg.norm(g)
    torch_clipped = g * min(1.0, 2.0 / (total + 1e-6))
    ours, _ = optim.clip_by_global_norm(2.0).update(
        {"g": jnp.asarray(g, jnp.float32)}, optim.GlobalNormState(jnp.float32(0))
    )
    np.testing.assert_allclose(ours["g"], torch_clipped, rtol=1e-6)


def test_small_gradients_pass_through_unchanged():
    grads = {"g": jnp.asarray([0.3, -0.4])}
    clipped, state = optim.clip_by_global_norm(1.0).update(grads, optim.GlobalNormState(jnp.float32(0)))
    np.testing.assert_array_equal(clipped["g"], grads["g"])
    np.testing.assert_allclose(state.global_norm, 0.5, rtol=1e-6)


def test_axis_name_gives_every_shard_the_norm_of_the_whole_tree(sample_params):
    """Emulate 2 devices with vmap: each leaf split along its first axis (scalars replicated would be counted
    twice, so the tree here holds only splittable leaves)."""
    tree = {"w": sample_params["w"], "conv": sample_params["conv"]}  # leading sizes 6 and 2
    shards = jax.tree_util.tree_map(lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:]), tree)
    tx = optim.clip_by_global_norm(1.0, axis_name="devices")

    def clip_shard(shard):
        return tx.update(shard, tx.init(shard))

    clipped, state = jax.vmap(clip_shard, axis_name="devices")(shards)
    want, want_state = optim.clip_by_global_norm(1.0).update(tree, optim.GlobalNormState(jnp.float32(0)))
    np.testing.assert_allclose(state.global_norm, [want_state.global_norm] * 2, rtol=1e-6)
    joined = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), clipped)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), joined, want)
