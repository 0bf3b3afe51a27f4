"""purejax.nn.batch_norm against torch's BatchNorm conventions written out in float64 numpy, the cross-device
statistics against the single-device run on the concatenated batch, and the stateful-layer transforms
(vmap over models, scan over steps and over layers, cond between train and eval)."""

import functools
import operator
import subprocess
import sys
import textwrap
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from purejax.nn import batch_norm


class TorchBatchNorm:
    """torch.nn.BatchNorm{1,2}d's arithmetic in float64: normalise with the biased batch variance, update the
    running variance with the unbiased one, running = (1 - momentum) * running + momentum * batch."""

    def __init__(self, features, momentum=0.1, eps=1e-5):
        self.mean, self.var = np.zeros(features), np.ones(features)
        self.momentum, self.eps = momentum, eps

    def __call__(self, x, scale, bias, train):
        x = np.asarray(x, np.float64)
        axes = tuple(range(x.ndim - 1))
        if train:
            n = x.size // x.shape[-1]
            mean, var = x.mean(axes), x.var(axes)
            self.mean = (1 - self.momentum) * self.mean + self.momentum * mean
            self.var = (1 - self.momentum) * self.var + self.momentum * var * n / (n - 1)
        else:
            mean, var = self.mean, self.var
        return (x - mean) / np.sqrt(var + self.eps) * scale + bias


def random_params(features, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "scale": jnp.asarray(rng.uniform(0.5, 1.5, features), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=features), jnp.float32),
    }


@pytest.mark.parametrize("shape", [(16, 5), (4, 3, 3, 5)], ids=["batch_features", "nhwc"])
@pytest.mark.parametrize("momentum", [0.1, 0.3])
def test_several_train_steps_then_eval_match_torch_convention(shape, momentum):
    rng = np.random.default_rng(1)
    params, state = random_params(5), batch_norm.init_state(5)
    reference = TorchBatchNorm(5, momentum=momentum)
    step = jax.jit(lambda p, s, x: batch_norm.apply(p, x, s, train=True, momentum=momentum))
    for i in range(4):
        x = rng.normal(loc=i, scale=1 + i, size=shape).astype(np.float32)
        y, state = step(params, state, jnp.asarray(x))
        want = reference(x, np.asarray(params["scale"]), np.asarray(params["bias"]), train=True)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(state["mean"], reference.mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["var"], reference.var, rtol=1e-5, atol=1e-6)
    x = rng.normal(size=shape).astype(np.float32)
    y, eval_state = batch_norm.apply(params, jnp.asarray(x), state, train=False)
    assert eval_state is state
    want = reference(x, np.asarray(params["scale"]), np.asarray(params["bias"]), train=False)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_gradients_match_the_batch_norm_backward_formula():
    # Ioffe & Szegedy 2015, section 3: dx = scale / sqrt(var + eps) * (dy - mean(dy) - xhat * mean(dy * xhat))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 2, 2, 3)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    params, state = random_params(3), batch_norm.init_state(3)
    loss = lambda p, x: jnp.sum(batch_norm.apply(p, x, state, train=True)[0] * dy)  # noqa: E731
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(x))
    x64, dy64, axes = x.astype(np.float64), dy.astype(np.float64), (0, 1, 2)
    xhat = (x64 - x64.mean(axes)) / np.sqrt(x64.var(axes) + 1e-5)
    scale = np.asarray(params["scale"], np.float64)
    want_x = scale / np.sqrt(x64.var(axes) + 1e-5) * (dy64 - dy64.mean(axes) - xhat * (dy64 * xhat).mean(axes))
    np.testing.assert_allclose(g_x, want_x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_params["scale"], (dy64 * xhat).sum(axes), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_params["bias"], dy64.sum(axes), rtol=1e-5, atol=1e-5)


def test_low_precision_input_keeps_its_dtype_and_float32_state():
    x = jnp.asarray(np.random.default_rng(3).normal(3.0, 2.0, size=(8, 4)), jnp.bfloat16)
    y, state = batch_norm.apply(batch_norm.init(None, 4), x, batch_norm.init_state(4), train=True)
    assert y.dtype == jnp.bfloat16
    assert state["mean"].dtype == state["var"].dtype == jnp.float32
    np.testing.assert_allclose(jnp.mean(y.astype(jnp.float32), axis=0), 0.0, atol=3e-2)


# ------------------------------------------------------------------------------------------------ cross-device


def test_cross_device_statistics_under_vmap_equal_the_concatenated_batch():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(2.0, 3.0, size=(4, 3, 2, 2, 5)), jnp.float32)  # 4 "devices", 3 images each
    params, state = random_params(5), batch_norm.init_state(5)
    sharded = jax.vmap(lambda x: batch_norm.apply(params, x, state, train=True, axis_name="data"), axis_name="data")
    y, new_state = sharded(x)
    y_single, state_single = batch_norm.apply(params, x.reshape(12, 2, 2, 5), state, train=True)
    np.testing.assert_allclose(y.reshape(12, 2, 2, 5), y_single, rtol=1e-5, atol=1e-5)
    for device in range(4):  # every device ends with the same running statistics, those of the whole batch
        chex.assert_trees_all_close(
            jax.tree.map(operator.itemgetter(device), new_state), state_single, rtol=1e-5, atol=1e-6
        )
    # without axis_name each device uses its own statistics, which differ: the test above can fail
    y_local, _ = jax.vmap(lambda x: batch_norm.apply(params, x, state, train=True))(x)
    assert not np.allclose(y_local.reshape(12, 2, 2, 5), y_single, atol=1e-3)


def test_inside_shard_map_on_a_one_device_mesh():
    mesh = jax.make_mesh((1,), ("data",))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(6, 3)), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    params, state = random_params(3), batch_norm.init_state(3)
    fn = jax.shard_map(
        lambda x: batch_norm.apply(params, x, state, train=True, axis_name="data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=(P("data"), P()),
    )
    y, new_state = jax.jit(fn)(x)
    chex.assert_trees_all_close((y, new_state), batch_norm.apply(params, x, state, train=True), rtol=1e-6, atol=1e-6)


def test_inside_shard_map_across_four_cpu_devices():
    """A real multi-device run needs a fresh process (the device count is fixed when jax starts)."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from purejax.nn import batch_norm
        assert jax.device_count() == 4, jax.devices()
        mesh = jax.make_mesh((4,), ("data",))
        x = jnp.asarray(np.random.default_rng(0).normal(1.0, 2.0, size=(8, 3, 3, 4)), jnp.float32)
        params, state = batch_norm.init(None, 4), batch_norm.init_state(4)
        fn = jax.shard_map(lambda x: batch_norm.apply(params, x, state, train=True, axis_name="data"),
                           mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
        y, new_state = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P("data"))))
        y1, state1 = batch_norm.apply(params, x, state, train=True)
        np.testing.assert_allclose(y, y1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_state["var"], state1["var"], rtol=1e-5)
        np.testing.assert_allclose(new_state["mean"], state1["mean"], rtol=1e-5, atol=1e-6)
        print("ok")
        """
    )
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PATH": ""}
    repo = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ transforms


def test_vmap_over_independent_models_and_states():
    rng = np.random.default_rng(6)
    params = jax.tree.map(lambda *a: jnp.stack(a), *[random_params(4, seed) for seed in range(3)])
    states = {
        "mean": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "var": jnp.asarray(rng.uniform(1, 2, (3, 4)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    for train in (True, False):
        y, new = jax.vmap(functools.partial(batch_norm.apply, train=train))(params, x, states)
        for m in range(3):
            one = functools.partial(jax.tree.map, operator.itemgetter(m))
            y_m, new_m = batch_norm.apply(one(params), x[m], one(states), train=train)
            chex.assert_trees_all_close((y[m], one(new)), (y_m, new_m), rtol=1e-6, atol=1e-6)


def test_scan_threads_the_state_through_training_steps():
    rng = np.random.default_rng(7)
    params, state = random_params(4), batch_norm.init_state(4)
    xs = jnp.asarray(rng.normal(1.0, 2.0, size=(5, 8, 4)), jnp.float32)

    def step(state, x):
        y, state = batch_norm.apply(params, x, state, train=True)
        return state, y

    final, ys = jax.lax.scan(step, state, xs)
    loop_state, reference = state, TorchBatchNorm(4)
    for t in range(5):
        y_t, loop_state = batch_norm.apply(params, xs[t], loop_state, train=True)
        chex.assert_trees_all_close(ys[t], y_t, rtol=1e-6, atol=1e-6)
        reference(np.asarray(xs[t]), 1.0, 0.0, train=True)
    chex.assert_trees_all_close(final, loop_state, rtol=1e-6)
    np.testing.assert_allclose(final["var"], reference.var, rtol=1e-5)


def test_scan_over_stacked_layers_returns_stacked_states():
    rng = np.random.default_rng(8)
    n_layers = 3
    params = jax.tree.map(lambda *a: jnp.stack(a), *[random_params(4, seed) for seed in range(n_layers)])
    states = jax.tree.map(lambda a: jnp.stack([a] * n_layers), batch_norm.init_state(4))
    x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)

    def layer(h, layer_params_and_state):
        p, s = layer_params_and_state
        h, s = batch_norm.apply(p, jnp.tanh(h) * 3.0, s, train=True)
        return h, s

    y, new_states = jax.lax.scan(layer, x, (params, states))
    h = x
    for i in range(n_layers):
        layer_params = jax.tree.map(operator.itemgetter(i), params)
        h, s_i = batch_norm.apply(layer_params, jnp.tanh(h) * 3.0, batch_norm.init_state(4), train=True)
        chex.assert_trees_all_close(jax.tree.map(operator.itemgetter(i), new_states), s_i, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)


def test_cond_selects_train_or_eval_with_a_traced_flag():
    rng = np.random.default_rng(9)
    params = random_params(4)
    state = {
        "mean": jnp.asarray(rng.normal(size=4), jnp.float32),
        "var": jnp.asarray(rng.uniform(1, 2, 4), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)

    @jax.jit
    def run(is_training, state, x):
        return jax.lax.cond(
            is_training,
            lambda s, x: batch_norm.apply(params, x, s, train=True),
            lambda s, x: batch_norm.apply(params, x, s, train=False),
            state,
            x,
        )

    for flag in (True, False):
        got = run(jnp.asarray(flag), state, x)
        chex.assert_trees_all_close(got, batch_norm.apply(params, x, state, train=flag), rtol=1e-6, atol=1e-6)
    assert not np.allclose(run(jnp.asarray(True), state, x)[0], run(jnp.asarray(False), state, x)[0])


# ------------------------------------------------------------------------------------------------ errors


def test_errors_name_what_is_wrong():
    params, state, x = batch_norm.init(None, 4), batch_norm.init_state(4), jnp.ones((2, 4))
    with pytest.raises(
        KeyError, match=r"state must be a dict with keys \['mean', 'var'\].* got \['mean', 'variance'\]"
    ):
        batch_norm.apply(params, x, {"mean": state["mean"], "variance": state["var"]}, train=True)
    with pytest.raises(KeyError, match=r"batch_norm: params have missing keys \['bias'\]"):
        batch_norm.apply({"scale": params["scale"]}, x, state, train=True)
    with pytest.raises(ValueError, match=r"batch_norm: x has shape \(2, 3\), but its axis -1 must be 4"):
        batch_norm.apply(params, jnp.ones((2, 3)), state, train=True)
    with pytest.raises(ValueError, match=r"state\['var'\] has shape \(5,\), expected \(4,\)"):
        batch_norm.apply(params, x, {"mean": state["mean"], "var": jnp.ones(5)}, train=False)
    with pytest.raises(ValueError, match="more than one value per channel"):
        batch_norm.apply(params, jnp.ones((1, 1, 1, 4)), state, train=True)
    with pytest.raises(ValueError, match="momentum must be in"):
        batch_norm.apply(params, x, state, train=True, momentum=1.5)
    with pytest.raises(ValueError, match="at least one batch axis"):
        batch_norm.apply(params, jnp.ones(4), state, train=False)
    with pytest.raises(ValueError, match="channels must be positive"):
        batch_norm.init_state(0)
