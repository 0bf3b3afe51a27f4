"""purejax.optim.train_step with a model state (BatchNorm statistics): threaded through loss_fn, updated once
per step with micro-batches (checked against the unaccumulated runs and float64 numpy), kept on a skipped step,
checkpointed with the rest (old checkpoints without the field load), and the mismatches explained."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import checkpoint, optim
from purejax import tree as tree_lib
from purejax.nn import batch_norm, linear

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 3)).astype(np.float32)
BATCH = {"x": jnp.asarray(X), "y": jnp.asarray(X @ RNG.normal(size=(3, 4)).astype(np.float32))}
PARAMS = {"fc": linear.init(jax.random.key(0), 3, 4), "bn": batch_norm.init(None, 4)}
MOMENTUM = 0.1


def bn_loss(params, model_state, batch, key):
    """A linear layer, then BatchNorm in train mode: the loss of the normalised output."""
    del key
    h, new_state = batch_norm.apply(
        params["bn"], linear.apply(params["fc"], batch["x"]), model_state, train=True, momentum=MOMENTUM
    )
    return jnp.mean(jnp.square(h - batch["y"])), ({"h_mean": jnp.mean(h)}, new_state)


def fresh_state(optimizer=None, **kwargs):
    optimizer = optimizer or optim.sgd(0.1)
    return optim.init_train_state(PARAMS, optimizer, jax.random.key(1), model_state=batch_norm.init_state(4), **kwargs)


def step_fn(micro_batches=1, loss_fn=bn_loss, optimizer=None):
    optimizer = optimizer or optim.sgd(0.1)
    return jax.jit(
        functools.partial(optim.train_step, loss_fn=loss_fn, optimizer=optimizer, micro_batches=micro_batches)
    )


def micro_batch(i, k=4):
    n = len(X) // k
    return jax.tree_util.tree_map(lambda a: a[i * n : (i + 1) * n], BATCH)


def test_the_statistics_are_updated_by_the_step_and_returned_in_the_state():
    state, metrics = step_fn()(fresh_state(), BATCH)
    features = X.astype(np.float64) @ np.asarray(PARAMS["fc"]["w"], np.float64) + np.asarray(PARAMS["fc"]["b"])
    np.testing.assert_allclose(state.model_state["mean"], MOMENTUM * features.mean(0), rtol=1e-5, atol=1e-6)
    want_var = (1 - MOMENTUM) + MOMENTUM * features.var(0, ddof=1)  # the running var starts at 1
    np.testing.assert_allclose(state.model_state["var"], want_var, rtol=1e-5)
    assert set(metrics) >= {"loss", "h_mean"} and "model_state" not in metrics


def test_micro_batches_update_the_statistics_once_per_step_as_the_mean_of_the_unaccumulated_runs():
    """Every micro-batch starts from the step's state and the new state is their mean: exactly the mean of
    four unaccumulated steps on the micro-batches; for the running mean also the whole batch's step."""
    accumulated, _ = step_fn(micro_batches=4)(fresh_state(), BATCH)
    singles = [step_fn()(fresh_state(), micro_batch(i))[0] for i in range(4)]
    mean_of_singles = jax.tree_util.tree_map(lambda *s: np.mean(np.stack(s), 0), *[s.model_state for s in singles])
    chex.assert_trees_all_close(accumulated.model_state, mean_of_singles, rtol=1e-6, atol=1e-7)
    # sgd is linear in the gradient, so the params are the mean of the four steps' params too
    mean_params = jax.tree_util.tree_map(lambda *p: np.mean(np.stack(p), 0), *[s.params for s in singles])
    chex.assert_trees_all_close(accumulated.params, mean_params, rtol=1e-5, atol=1e-6)
    whole, _ = step_fn()(fresh_state(), BATCH)
    np.testing.assert_allclose(accumulated.model_state["mean"], whole.model_state["mean"], rtol=1e-5, atol=1e-7)
    assert int(accumulated.step) == 1


def test_the_statistics_stay_put_on_a_skipped_step():
    def poisoned(params, model_state, batch, key):
        loss, out = bn_loss(params, model_state, batch, key)
        return loss * batch["poison"][0], out

    step = step_fn(micro_batches=2, loss_fn=poisoned)
    state, _ = step(fresh_state(), {**BATCH, "poison": jnp.ones(32)})
    kept, metrics = step(state, {**BATCH, "poison": jnp.full(32, jnp.inf)})
    assert bool(metrics["skipped"])
    chex.assert_trees_all_equal((kept.params, kept.model_state), (state.params, state.model_state))


def test_integer_state_leaves_keep_their_dtype_and_take_the_last_micro_batch():
    def counting(params, model_state, batch, key):
        loss, (aux, bn) = bn_loss(params, model_state["bn"], batch, key)
        return loss, (aux, {"bn": bn, "seen": model_state["seen"] + batch["x"].shape[0]})

    model_state = {"bn": batch_norm.init_state(4), "seen": jnp.zeros((), jnp.int32)}
    state = optim.init_train_state(PARAMS, optim.sgd(0.1), jax.random.key(1), model_state=model_state)
    state, _ = step_fn(micro_batches=4, loss_fn=counting)(state, BATCH)
    assert state.model_state["seen"].dtype == jnp.int32 and int(state.model_state["seen"]) == 8


def test_the_model_state_is_checkpointed_and_a_checkpoint_from_before_the_field_still_loads(tmp_path):
    state, _ = step_fn()(fresh_state(), BATCH)
    checkpoint.save(tmp_path / "stateful.msgpack", state, step=1)
    restored, _ = checkpoint.restore(tmp_path / "stateful.msgpack", like=fresh_state())
    chex.assert_trees_all_equal(restored.model_state, state.model_state)
    assert "model_state.mean" in tree_lib.flatten(restored)

    # A TrainState saved before `model_state` existed: the same six fields.
    old = optim.init_train_state(PARAMS, optim.sgd(0.1), jax.random.key(1))
    old_layout = {name: getattr(old, name) for name in ("params", "opt_state", "loss_scale", "ema", "step", "key")}
    checkpoint.save(tmp_path / "old.msgpack", old_layout, step=0)
    loaded, _ = checkpoint.restore(tmp_path / "old.msgpack", like=old)  # a stateless model: loads as it is
    assert loaded.model_state is None
    chex.assert_trees_all_equal(loaded.params, old.params)
    with pytest.raises(tree_lib.TreeMismatchError, match=r"missing:\s+model_state\.mean"):
        checkpoint.restore(tmp_path / "old.msgpack", like=fresh_state())  # a stateful one: named, not guessed


def test_a_loss_fn_of_the_wrong_form_is_explained():
    stateful, stateless = fresh_state(), optim.init_train_state(PARAMS, optim.sgd(0.1), jax.random.key(1))
    step = functools.partial(optim.train_step, optimizer=optim.sgd(0.1))

    def three_args(params, batch, key):
        return jnp.float32(0.0), {}

    with pytest.raises(TypeError, match=r"has a model_state, so loss_fn is called as loss_fn\(params, model_state"):
        step(stateful, BATCH, loss_fn=three_args)
    with pytest.raises(TypeError, match=r"needs init_train_state\(\.\.\., model_state=\.\.\.\)"):
        step(stateless, BATCH, loss_fn=bn_loss)
    with pytest.raises(TypeError, match=r"must return \(loss, \(aux, new_model_state\)\)"):
        step(stateful, BATCH, loss_fn=lambda p, s, b, k: bn_loss(p, s, b, k)[0])
    with pytest.raises(TypeError, match=r"returned \(loss, \(aux, model_state\)\), but the TrainState has no"):
        step(stateless, BATCH, loss_fn=lambda p, b, k: (jnp.float32(0.0), ({}, {})))
    with pytest.raises(tree_lib.TreeMismatchError, match=r"model_state loss_fn returned.*\n.*shape mismatch: mean"):
        step(stateful, BATCH, loss_fn=lambda p, s, b, k: (jnp.float32(0.0), ({}, {**s, "mean": jnp.zeros(3)})))
