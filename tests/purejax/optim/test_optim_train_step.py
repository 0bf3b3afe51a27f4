"""purejax.optim.train_step: the whole step. Convergence, micro-batches equal the whole batch, jit equals
eager, the non-finite skip, float16 with dynamic loss scaling, bfloat16 compute on float32 master params,
clipping against optax, the sharded-norm hook, and the errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import optim
from purejax import tree as tree_lib
from purejax.optim import schedules
from purejax.precision import Policy, with_policy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 8)).astype(np.float32)
W_TRUE = RNG.normal(size=(8, 4)).astype(np.float32)
BATCH = {"x": jnp.asarray(X), "y": jnp.asarray(X @ W_TRUE + 0.5)}
PARAMS = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}


def loss_fn(params, batch, key):
    del key
    error = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.mean(jnp.square(error)), {"mae": jnp.mean(jnp.abs(error))}


def mse(params):
    return float(loss_fn(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params), BATCH, None)[0])


def make_step(**kwargs):
    return jax.jit(functools.partial(optim.train_step, **kwargs))


def test_training_converges_and_reports_every_metric():
    schedule = schedules.warmup_cosine(0.1, 10, 200, 0.01)
    optimizer = optim.adamw(schedule, weight_decay=0.0)
    ema = optim.param_ema(optim.ema_warmup(0.9))
    params = jax.tree_util.tree_map(jnp.copy, PARAMS)  # the state takes these buffers over, and they are donated
    state = optim.init_train_state(params, optimizer, jax.random.key(0), loss_scale=optim.dynamic_loss_scale(), ema=ema)

    @functools.partial(jax.jit, donate_argnums=0)  # every buffer of the state is its own: donation is safe
    @chex.assert_max_traces(n=1)
    def step(state, batch):
        return optim.train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=10.0, ema=ema)

    first = mse(PARAMS)
    for i in range(150):
        state, metrics = step(state, BATCH)
        np.testing.assert_allclose(metrics["learning_rate"], schedule(i), rtol=1e-6)
    assert set(metrics) == {"loss", "grad_norm", "learning_rate", "loss_scale", "skipped", "mae"}
    assert mse(state.params) < first / 1000 and mse(ema.value(state.ema)) < first / 100
    assert int(state.step) == 150 and int(state.opt_state["adam"].count) == 150 and not bool(metrics["skipped"])


def test_train_state_is_a_named_pytree():
    ema = optim.param_ema(0.99)
    state = optim.init_train_state(
        PARAMS, optim.adamw(1e-3), jax.random.key(0), loss_scale=optim.dynamic_loss_scale(), ema=ema
    )
    paths = set(tree_lib.flatten(state))
    assert {"params.w", "opt_state.adam.mu.w", "loss_scale.min_loss_scale", "ema.average.w", "step", "key"} <= paths


def test_micro_batches_give_the_same_step_as_the_whole_batch():
    optimizer = optim.sgd(0.05, momentum=0.9)
    results = {}
    for k in (1, 4):
        state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0))
        step = make_step(loss_fn=loss_fn, optimizer=optimizer, micro_batches=k)
        for _ in range(3):
            state, metrics = step(state, BATCH)
        results[k] = (state.params, metrics["loss"], metrics["mae"])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), results[4], results[1])


def test_jit_and_eager_agree():
    optimizer = optim.adamw(1e-2)
    ema = optim.param_ema(0.9, debias=True)
    kwargs = dict(loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0, ema=ema)
    eager = jitted = optim.init_train_state(
        PARAMS, optimizer, jax.random.key(0), loss_scale=optim.dynamic_loss_scale(2.0**10, period=2), ema=ema
    )
    step = make_step(**kwargs)
    for _ in range(2):
        eager, eager_metrics = optim.train_step(eager, BATCH, **kwargs)
        jitted, jitted_metrics = step(jitted, BATCH)
    same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # noqa: E731
    jax.tree_util.tree_map(
        same,
        (eager.params, eager.opt_state, eager.ema, eager.loss_scale),
        (jitted.params, jitted.opt_state, jitted.ema, jitted.loss_scale),
    )
    jax.tree_util.tree_map(same, eager_metrics, jitted_metrics)


def poisoned_loss(params, batch, key):
    loss, aux = loss_fn(params, batch, key)
    return loss * batch["poison"], aux


def test_non_finite_gradients_skip_the_update_and_back_off_the_scale():
    optimizer = optim.adam(1e-2)
    ema = optim.param_ema(0.9)
    state = optim.init_train_state(
        PARAMS, optimizer, jax.random.key(0), loss_scale=optim.dynamic_loss_scale(2.0**10), ema=ema
    )
    step = make_step(loss_fn=poisoned_loss, optimizer=optimizer, ema=ema)
    state, _ = step(state, {**BATCH, "poison": jnp.float32(1.0)})
    before = state
    state, metrics = step(state, {**BATCH, "poison": jnp.float32(jnp.inf)})
    assert bool(metrics["skipped"]) and not np.isfinite(float(metrics["grad_norm"]))
    chex.assert_trees_all_equal(
        (state.params, state.opt_state, state.ema), (before.params, before.opt_state, before.ema)
    )
    assert float(state.loss_scale.loss_scale) == 2.0**9 and int(state.step) == 2
    state, metrics = step(state, {**BATCH, "poison": jnp.float32(1.0)})
    assert not bool(metrics["skipped"]) and int(state.opt_state["adam"].count) == 2


def tiny_loss(params, batch, key):
    """A loss whose float16 gradients are below float16's smallest subnormal (6e-8) unless scaled up."""
    error = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.mean(jnp.square(error)) * 2.0**-20, {}


def test_float16_with_dynamic_loss_scaling_trains_where_unscaled_float16_underflows():
    f16_loss = with_policy(tiny_loss, Policy.from_string("params=float32,compute=float16,output=float32"))
    optimizer = optim.lion(3e-2, weight_decay=0.0)  # a sign update: the tiny gradient's scale does not matter
    finals, skipped = {}, {}
    for name, scale in (("unscaled", optim.NoLossScale()), ("dynamic", optim.dynamic_loss_scale(2.0**15, period=5))):
        state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0), loss_scale=scale)
        step = make_step(loss_fn=f16_loss, optimizer=optimizer)
        norms, skipped[name] = [], 0
        for _ in range(200):
            state, metrics = step(state, BATCH)
            norms.append(float(metrics["grad_norm"]))
            skipped[name] += int(metrics["skipped"])
        finals[name] = (state, norms)
    unscaled, unscaled_norms = finals["unscaled"]
    assert max(unscaled_norms) == 0.0  # every float16 gradient flushed to zero ...
    chex.assert_trees_all_equal(unscaled.params, PARAMS)  # ... so nothing was learned
    scaled, _ = finals["dynamic"]
    assert mse(scaled.params) < mse(PARAMS) / 20
    # The scale is also the cotangent entering the float16 graph, so 2**16 > 65504 overflows: the scale grows to it,
    # the step is skipped, and it backs off to 2**15.
    assert skipped["dynamic"] > 0 and float(scaled.loss_scale.loss_scale) in (2.0**14, 2.0**15)


def test_bfloat16_compute_keeps_float32_master_params():
    bf16_loss = with_policy(loss_fn, Policy.from_string("params=float32,compute=bfloat16,output=float32"))
    optimizer = optim.adam(1e-4)  # updates far below bfloat16's resolution near 1 (2**-7)
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    state = optim.init_train_state(params, optimizer, jax.random.key(0))
    step = make_step(loss_fn=bf16_loss, optimizer=optimizer)
    for _ in range(5):
        state, metrics = step(state, BATCH)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(state.params))
    moved = np.abs(np.asarray(state.params["w"]) - 1.0)
    np.testing.assert_allclose(moved, 5e-4, rtol=0.05)  # 5 steps of ~lr each survive in float32 ...
    assert np.all(np.asarray(jnp.asarray(state.params["w"], jnp.bfloat16), np.float32) == 1.0)  # ... not in bfloat16
    f32_state = optim.init_train_state(params, optimizer, jax.random.key(0))
    f32_state, f32_metrics = make_step(loss_fn=loss_fn, optimizer=optimizer)(f32_state, BATCH)
    np.testing.assert_allclose(metrics["loss"], f32_metrics["loss"], rtol=0.05)  # the same problem, rounded


def test_clipping_in_the_step_equals_optax_clip_in_the_chain():
    clipped_in_step = make_step(loss_fn=loss_fn, optimizer=optax.adamw(1e-2), max_grad_norm=0.5)
    clipped_in_chain = make_step(
        loss_fn=loss_fn, optimizer=optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    )
    a = optim.init_train_state(PARAMS, optax.adamw(1e-2), jax.random.key(0))
    b = optim.init_train_state(
        PARAMS, optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), jax.random.key(0)
    )
    for _ in range(20):
        a, metrics = clipped_in_step(a, BATCH)
        b, _ = clipped_in_chain(b, BATCH)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a.params, b.params)
    assert "learning_rate" not in metrics  # a plain optax optimizer keeps no rate in its state


def test_axis_name_sums_the_norm_over_devices():
    """Two emulated devices holding identical halves: the norm of the whole is sqrt(2) times a half's norm."""
    optimizer = optim.sgd(0.1)
    state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0))
    _, single = make_step(loss_fn=loss_fn, optimizer=optimizer)(state, BATCH)
    step = functools.partial(optim.train_step, loss_fn=loss_fn, optimizer=optimizer, axis_name="devices")
    _, both = jax.jit(jax.vmap(step, in_axes=(None, None), axis_size=2, axis_name="devices"))(state, BATCH)
    np.testing.assert_allclose(both["grad_norm"], [np.sqrt(2) * single["grad_norm"]] * 2, rtol=1e-6)


def test_grad_reduce_runs_once_per_step_and_makes_data_parallel_equal_the_whole_batch():
    """Two emulated devices, each with half the batch and its own half's mean loss: `grad_reduce=pmean` gives
    each the whole batch's gradient, so the step equals the single-device one; called once per step (one
    reduction, whatever the micro-batches), before the norm."""
    optimizer = optim.adamw(1e-2)
    calls = []

    def pmean(grads):
        calls.append(1)
        return jax.lax.pmean(grads, "data")

    state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0))
    kwargs = dict(loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0, micro_batches=2)
    want, want_metrics = make_step(**kwargs)(state, BATCH)
    step = functools.partial(optim.train_step, grad_reduce=pmean, **kwargs)
    halves = jax.tree_util.tree_map(lambda x: x.reshape(2, -1, *x.shape[1:]), BATCH)
    got, metrics = jax.jit(jax.vmap(step, in_axes=(None, 0), axis_name="data"))(state, halves)
    assert len(calls) == 1
    jax.tree_util.tree_map(
        lambda g, w: np.testing.assert_allclose(g, np.stack([w, w]), rtol=1e-5, atol=1e-7), got.params, want.params
    )
    np.testing.assert_allclose(metrics["grad_norm"], [want_metrics["grad_norm"]] * 2, rtol=1e-5)


def test_loss_fn_mistakes_are_explained():
    state = optim.init_train_state(PARAMS, optim.sgd(0.1), jax.random.key(0))
    step = functools.partial(optim.train_step, optimizer=optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"must return \(loss, aux\).*got a single array.*return loss, \{\}"):
        step(state, BATCH, loss_fn=lambda p, b, k: loss_fn(p, b, k)[0])
    with pytest.raises(ValueError, match=r"aux uses the names \['grad_norm'\]"):
        step(state, BATCH, loss_fn=lambda p, b, k: (loss_fn(p, b, k)[0], {"grad_norm": 0.0}))
    with pytest.raises(TypeError, match=r"scalar loss, got shape \(64,\)"):
        step(state, BATCH, loss_fn=lambda p, b, k: (jnp.sum(b["x"] @ p["w"], axis=1), {}))
    with pytest.raises(ValueError, match="pass the same param_ema to init_train_state and train_step"):
        step(state, BATCH, loss_fn=loss_fn, ema=optim.param_ema(0.9))


def test_train_state_checkpoints_as_it_is_and_training_resumes_identically(tmp_path):
    from purejax import checkpoint

    optimizer = optim.adamw(schedules.warmup_cosine(1e-2, 3, 50), weight_decay=0.1, mask=optim.ndim_at_least(2))
    ema = optim.param_ema(0.9, debias=True)
    scale = optim.dynamic_loss_scale(2.0**12, period=3, min_loss_scale=2.0**8)
    state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0), loss_scale=scale, ema=ema)
    step = make_step(loss_fn=loss_fn, optimizer=optimizer, ema=ema, max_grad_norm=1.0)
    for _ in range(4):
        state, _ = step(state, BATCH)
    checkpoint.save(tmp_path / "ckpt.msgpack", state, step=int(state.step))
    restored, _ = checkpoint.restore(tmp_path / "ckpt.msgpack", like=state)
    assert float(restored.loss_scale.min_loss_scale) == 2.0**8  # every field of the loss scale is stored
    chex.assert_trees_all_equal(step(restored, BATCH), step(state, BATCH))
