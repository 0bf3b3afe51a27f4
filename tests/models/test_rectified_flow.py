"""models.rectified_flow against numpy: the loss and its pieces, the time distributions, separate keys for
t and the noise, the Euler sampler (exact on a flow whose velocity is known, guidance combined as written,
deterministic from a seed, traced once), MicroDiT's masked loss, and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import dit
from models import rectified_flow as rf
from purejax import random as prandom

FLOW = rf.FlowConfig(time_sampling="uniform", label_dropout=0.25, null_class=5)


def test_interpolate_and_per_sample_loss_match_numpy():
    rng = np.random.default_rng(0)
    x, eps, v = (rng.normal(size=(4, 3, 3, 2)).astype(np.float32) for _ in range(3))
    t = rng.uniform(size=4).astype(np.float32)
    z = rf.interpolate(jnp.asarray(x), jnp.asarray(eps), jnp.asarray(t))
    np.testing.assert_allclose(z, (1 - t[:, None, None, None]) * x + t[:, None, None, None] * eps, rtol=1e-6)
    want = ((v - (eps - x)) ** 2).reshape(4, -1).mean(1)
    np.testing.assert_allclose(rf.per_sample_loss(jnp.asarray(v), jnp.asarray(x), jnp.asarray(eps)), want, rtol=1e-5)

    kept = rng.uniform(size=(4, 3, 3, 1)) < 0.5
    kept[:, 0, 0] = True
    err = (v - (eps - x)) ** 2 * kept
    want = err.reshape(4, -1).sum(1) / (np.broadcast_to(kept, v.shape).reshape(4, -1).sum(1))
    got = rf.per_sample_loss(jnp.asarray(v), jnp.asarray(x), jnp.asarray(eps), jnp.asarray(kept))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    v2 = np.where(kept, v, v + 100.0)  # what the model says about dropped pixels does not count
    masked = rf.per_sample_loss(jnp.asarray(v2), jnp.asarray(x), jnp.asarray(eps), jnp.asarray(kept))
    np.testing.assert_allclose(masked, got)


def test_loss_assembles_the_draws_as_documented():
    """loss() against numpy: t, eps and the dropped labels drawn from the documented named keys, a linear
    'model' v = 0.5 * z + t, the per-sample MSE averaged."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, 5, 64)
    key = jax.random.key(3)
    seen = {}

    def predict(params, z, t, y, key):
        seen["y"] = y
        return params * z + t[:, None, None, None]

    loss, aux = rf.loss(predict, 0.5, jnp.asarray(x), jnp.asarray(y), FLOW, key=key)
    keys = prandom.named_keys(key, "time", "noise", "labels", "model")
    t = np.asarray(jax.random.uniform(keys["time"], (64,)), np.float64)[:, None, None, None]
    eps = np.asarray(jax.random.normal(keys["noise"], x.shape), np.float64)
    z = (1 - t) * x + t * eps
    want = np.mean(((0.5 * z + t) - (eps - x)) ** 2)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(aux["t_mean"]), t.mean(), rtol=1e-5)
    dropped = np.asarray(seen["y"]) == 5
    assert 5 < dropped.sum() < 30  # label_dropout 0.25 of 64
    np.testing.assert_array_equal(np.asarray(seen["y"])[~dropped], y[~dropped])


def test_time_and_noise_get_separate_keys():
    """With data x = 0, z_t = t * eps, so eps = z / t is observable. Drawing t and eps from one key makes
    eps a function of t (the logit-normal t is sigmoid of the very normal that becomes eps): correlation 1.
    The loss must show none."""
    x, y = jnp.zeros((2048, 1)), jnp.zeros(2048, jnp.int32)
    seen = {}

    def predict(params, z, t, y, key):
        seen.update(z=z, t=t)
        return z

    rf.loss(predict, None, x, y, rf.FlowConfig(label_dropout=0.0, null_class=5), key=jax.random.key(0))
    logit_t = np.log(seen["t"] / (1 - seen["t"]))
    eps = np.asarray(seen["z"][:, 0] / seen["t"])
    assert abs(np.corrcoef(logit_t, eps)[0, 1]) < 0.1

    key = jax.random.key(0)  # the bug this guards against, so the check above can be seen to work
    bad_t, bad_eps = jax.random.normal(key, (2048,)), jax.random.normal(key, (2048, 1))[:, 0]
    assert np.corrcoef(bad_t, bad_eps)[0, 1] > 0.99


def test_time_distributions_and_shift():
    t = rf.sample_time(jax.random.key(0), 20000, rf.FlowConfig(logit_mean=0.5, logit_std=0.8, null_class=5))
    logit = np.log(t / (1 - t))
    assert abs(logit.mean() - 0.5) < 0.03 and abs(logit.std() - 0.8) < 0.03
    u = rf.sample_time(jax.random.key(0), 20000, rf.FlowConfig(time_sampling="uniform", null_class=5))
    assert abs(float(u.mean()) - 0.5) < 0.01 and 0 < float(u.min()) and float(u.max()) < 1
    s = np.asarray(rf.shift_time(jnp.asarray([0.0, 0.25, 0.5, 1.0]), 3.0))
    np.testing.assert_allclose(s, [0.0, 0.75 / 1.5, 1.5 / 2.0, 1.0], rtol=1e-6)  # 3t / (1 + 2t)
    shifted = rf.sample_time(jax.random.key(0), 20000, rf.FlowConfig(time_sampling="uniform", shift=3.0, null_class=5))
    np.testing.assert_allclose(shifted, rf.shift_time(u, 3.0), rtol=1e-6)


# ---------------------------------------------------------------- sampling

TARGETS = np.array([[-2.0, 1.0], [3.0, 0.5], [0.0, 0.0]])  # per label; the last row is the null class's


def point_velocity(params, z, t, y):
    """The exact velocity of a flow whose data is the single point TARGETS[y]: z_t = (1 - t) x + t eps gives
    eps - x = (z - x) / t. Euler's steps then land on x exactly, whatever the number of steps."""
    return params * (z - jnp.asarray(TARGETS, z.dtype)[y]) / t[:, None]


def test_euler_lands_on_the_data_point_and_guidance_combines_velocities():
    y = jnp.asarray([0, 1, 0])
    out = rf.sample(point_velocity, 1.0, jax.random.key(0), y, shape=(2,), n_steps=3, null_class=2)
    np.testing.assert_allclose(out, TARGETS[[0, 1, 0]], atol=1e-5)
    # guidance w: v = v_null + w (v_y - v_null) = (z - (x_null + w (x_y - x_null))) / t: lands on that point
    out = rf.sample(point_velocity, 1.0, jax.random.key(0), y, shape=(2,), n_steps=4, guidance=2.5, null_class=2)
    np.testing.assert_allclose(out, 2.5 * TARGETS[[0, 1, 0]], atol=1e-5)


def test_euler_steps_match_a_numpy_loop():
    """A velocity that is not exact for Euler (v = a * z): numpy's explicit loop over the shifted grid."""
    noise_key = jax.random.key(1)
    got = rf.sample(
        lambda a, z, t, y: a * z * (1 + t[:, None]),
        0.7,
        noise_key,
        jnp.zeros(2, jnp.int32),
        shape=(3,),
        n_steps=5,
        guidance=1.0,
        null_class=1,
        shift=2.0,
    )
    z = np.asarray(jax.random.normal(noise_key, (2, 3)), np.float64)
    ts = np.linspace(1, 0, 6)
    ts = 2 * ts / (1 + ts)
    for t, t_next in zip(ts[:-1], ts[1:]):
        z = z + (t_next - t) * 0.7 * z * (1 + t)
    np.testing.assert_allclose(got, z, rtol=1e-5)


def test_sampler_is_deterministic_and_traced_once():
    traces = []

    def counting_velocity(params, z, t, y):
        traces.append(z.shape)
        return point_velocity(params, z, t, y)

    sample = jax.jit(functools.partial(rf.sample, counting_velocity, shape=(2,), n_steps=16, null_class=2))
    y = jnp.asarray([0, 1])
    a = sample(1.0, jax.random.key(0), y, guidance=1.0)
    b = sample(1.0, jax.random.key(0), y, guidance=1.0)
    np.testing.assert_array_equal(a, b)
    c = sample(0.5, jax.random.key(1), jnp.asarray([1, 1]), guidance=3.0)
    assert not np.allclose(a, c)
    assert traces == [(4, 2)]  # one trace of the (doubled) batch for 16 steps, three calls, new values


def test_masked_microdit_loss_runs_through_the_flow():
    """MicroDiT's masked forward plugs into the loss; at mask ratio 0 the loss is the plain model's."""
    config = dit.DiTConfig(
        input_size=4,
        patch_size=2,
        in_channels=1,
        d_model=16,
        n_layer=1,
        n_head=2,
        n_classes=5,
        learn_sigma=False,
        freq_dim=8,
        time_scale=1000.0,
        n_mixer=1,
    )
    rng = np.random.default_rng(0)
    noise = lambda a: a + rng.normal(0, 0.2, a.shape).astype(np.float32)  # noqa: E731
    params = jax.tree.map(noise, dit.init(jax.random.key(0), config))
    x, y = jnp.asarray(rng.normal(size=(4, 4, 4, 1)), jnp.float32), jnp.asarray([0, 1, 2, 3])

    def masked(ratio):
        return lambda p, z, t, y, key: dit.apply_masked(p, z, t, y, config, key=key, mask_ratio=ratio)

    def unmasked(p, z, t, y, key):
        return dit.velocity(p, z, t, y, config)

    @jax.jit
    def losses(params):
        return tuple(
            rf.loss(predict, params, x, y, FLOW, key=jax.random.key(2))[0]
            for predict in (unmasked, masked(0.0), masked(0.5))
        )

    plain, zero, half = losses(params)
    np.testing.assert_allclose(zero, plain, rtol=1e-5)
    assert np.isfinite(half) and not np.isclose(half, plain)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="logit_std and shift must be positive"):
        rf.FlowConfig(shift=0.0, null_class=5)
    with pytest.raises(ValueError, match="logit_std and shift must be positive"):
        rf.FlowConfig(logit_std=float("nan"), null_class=5)  # NaN compares false with everything
    with pytest.raises(ValueError, match="label_dropout"):
        rf.FlowConfig(label_dropout=1.5, null_class=5)
    with pytest.raises(ValueError, match="n_steps must be a positive int"):
        rf.sample(point_velocity, 1.0, jax.random.key(0), jnp.asarray([0]), shape=(2,), n_steps=0, null_class=2)
    with pytest.raises(ValueError, match="predict returned shape"):
        rf.loss(
            lambda p, z, t, y, key: jnp.concatenate([z, z], -1),
            None,
            jnp.zeros((2, 3)),
            jnp.zeros(2, jnp.int32),
            FLOW,
            key=jax.random.key(0),
        )
