"""purejax.optim.accumulate: micro-batch accumulation inside one step equals the whole-batch gradient, and the
MultiSteps-style wrapper matches optax.MultiSteps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim
from purejax import tree as tree_lib

RNG = np.random.default_rng(0)
BATCH = {
    "x": jnp.asarray(RNG.normal(size=(24, 5)), jnp.float32),
    "y": jnp.asarray(RNG.normal(size=(24, 3)), jnp.float32),
}
PARAMS = {"w": jnp.asarray(RNG.normal(size=(5, 3)), jnp.float32), "b": jnp.zeros(3)}


def loss_fn(params, batch, key):
    del key
    error = batch["x"] @ params["w"] + params["b"] - batch["y"]
    loss = jnp.mean(jnp.square(error))
    return loss, {"loss": loss, "max_error": jnp.max(jnp.abs(error))}


@functools.partial(jax.jit, static_argnums=0)
def accumulated(micro_batches, params, batch):
    grad_fn = jax.grad(loss_fn, has_aux=True)
    return optim.accumulate_gradients(grad_fn, params, batch, jax.random.key(0), micro_batches)


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 8])
def test_accumulated_gradient_equals_the_whole_batch_gradient(micro_batches):
    grads, aux = accumulated(micro_batches, PARAMS, BATCH)
    want, want_aux = jax.grad(loss_fn, has_aux=True)(PARAMS, BATCH, None)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want)
    np.testing.assert_allclose(aux["loss"], want_aux["loss"], rtol=1e-5)  # the mean of equal-sized means


def test_accumulation_is_a_scan_over_micro_batches():
    jaxpr = jax.make_jaxpr(lambda p, b: accumulated(4, p, b))(PARAMS, BATCH)
    assert "scan" in str(jaxpr) and "length=4" in str(jaxpr)


def test_each_micro_batch_gets_its_own_key():
    def noisy(params, batch, key):
        return jax.tree_util.tree_map(lambda p: jax.random.normal(key, p.shape), params), jax.random.normal(key, ())

    _, keys_seen = jax.lax.scan(
        lambda c, k: (c, jax.random.normal(k, ())), None, jax.random.split(jax.random.key(1), 3)
    )
    _, aux = optim.accumulate_gradients(noisy, PARAMS, BATCH, jax.random.key(1), 3)
    np.testing.assert_allclose(aux, jnp.mean(keys_seen), rtol=1e-6)


def test_indivisible_batch_names_every_leaf():
    batch = {"x": jnp.zeros((10, 5)), "y": jnp.zeros((10, 3)), "mask": jnp.zeros((12,))}
    with pytest.raises(ValueError, match=r"multiple of 4: x: float32\[10,5\], y: float32\[10,3\]$"):
        optim.split_micro_batches(batch, 4)


def _ours_multi(k):
    return lambda lr: optim.multi_steps(optim.adamw(lr, weight_decay=0.1), k)


def _theirs_multi(k):
    return lambda lr: optax.MultiSteps(optax.adamw(lr, weight_decay=0.1), k).gradient_transformation()


OURS = {k: _ours_multi(k) for k in (1, 3)}
THEIRS = {k: _theirs_multi(k) for k in (1, 3)}


@pytest.mark.parametrize("every_k", [1, 3])
@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 1e-1))
def test_multi_steps_matches_optax_multisteps_over_100_calls(parity, every_k, lr):
    parity(OURS[every_k], THEIRS[every_k], {"lr": lr})


def test_multi_steps_emits_zeros_between_updates_and_counts_real_steps():
    tx = optim.multi_steps(optim.sgd(1.0), 3)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    emitted = []
    for g in (1.0, 2.0, 6.0, 1.0):
        updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
        emitted.append(float(updates["w"][0]))
    assert emitted == [0.0, 0.0, -3.0, 0.0]  # the mean of 1, 2, 6, descended
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 1


def test_multi_steps_holds_one_extra_parameter_sized_buffer():
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
    inner = optim.adamw(1e-3)
    extra = tree_lib.count(optim.multi_steps(inner, 4).init(params)) - tree_lib.count(inner.init(params))
    assert extra == tree_lib.count(params) + 2  # the running mean, and two counters
