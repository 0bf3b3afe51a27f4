"""optax's extra keyword arguments (`value=`) through purejax: `chain`, `multi_steps` and `train_step` pass them
to the transforms that take them, against optax's own chain and a hand-written optax loop; and any optax
optimizer works in `train_step`, step for step as the optax loop."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import optim

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 4)).astype(np.float32)
BATCH = {"x": jnp.asarray(X), "y": jnp.asarray(X @ RNG.normal(size=(4, 2)).astype(np.float32))}
PARAMS = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
GRADS = jax.tree_util.tree_map(lambda p: jnp.asarray(RNG.normal(size=(12, *p.shape)), jnp.float32), PARAMS)


def test_extra_args_go_to_the_updates_that_accept_them():
    def named(updates, state, params=None, *, value): ...
    def anything(updates, state, params=None, **extra_args): ...
    def plain(updates, state, params=None): ...

    extra = {"value": 1.0, "other": 2}
    assert optim.extra_args_for(named, extra) == {"value": 1.0}
    assert optim.extra_args_for(anything, extra) == extra
    assert optim.extra_args_for(plain, extra) == {}
    assert optim.extra_args_for(max, extra) == {}  # no readable signature: none, as optax gives a plain transform


def run(tx, values, apply=optax.apply_updates):
    """Drive `tx` over GRADS with `value=values[i]` at step i; the params after each step."""

    def body(carry, xs):
        params, state = carry
        grads, value = xs
        updates, state = tx.update(grads, state, params, value=value)
        params = apply(params, updates)
        return (params, state), params

    return jax.lax.scan(body, (PARAMS, tx.init(PARAMS)), (GRADS, jnp.asarray(values, jnp.float32)))


def test_chain_passes_value_to_reduce_on_plateau_as_optax_chain_does():
    plateau = functools.partial(optax.contrib.reduce_on_plateau, factor=0.5, patience=2)
    values = [5.0, 4.0, 3.0] + [3.0] * 9  # stops improving after step 3: the scale halves from then on
    (_, ours_state), ours = run(optim.chain(adam=optim.adam(1e-2), plateau=plateau()), values, optim.apply_updates)
    (_, theirs_state), theirs = run(optax.chain(optax.adam(1e-2), plateau()), values)
    chex.assert_trees_all_close(ours, theirs, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal(ours_state["plateau"], theirs_state[1])
    assert float(ours_state["plateau"].scale) < 0.1


def test_multi_steps_passes_value_to_the_wrapped_optimizer_as_optax_multi_steps_does():
    values = np.linspace(3.0, 1.0, 12)
    polyak = functools.partial(optax.polyak_sgd, max_learning_rate=0.5)  # the step size is value / |g|**2
    _, ours = run(optim.multi_steps(polyak(), 3), values, optim.apply_updates)
    _, theirs = run(optax.MultiSteps(polyak(), 3).gradient_transformation(), values)
    chex.assert_trees_all_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert float(jnp.max(jnp.abs(ours["w"][-1]))) > 1e-3


def mse(params, batch, key):
    del key
    error = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.mean(jnp.square(error)), {}


def optax_loop(optimizer, steps):
    """The reference: optax's own loop, `value=` given to every update, as optax's docs write it."""
    params, state = PARAMS, optimizer.init(PARAMS)
    for _ in range(steps):
        (loss, _), grads = jax.value_and_grad(mse, has_aux=True)(params, BATCH, None)
        updates, state = optimizer.update(grads, state, params, value=loss)
        params = optax.apply_updates(params, updates)
    return params, state


OPTAX_OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "clip+sgd": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.05, momentum=0.9)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "polyak_sgd (value)": lambda: optax.polyak_sgd(max_learning_rate=0.1),
    "reduce_on_plateau (value)": lambda: optax.chain(
        optax.adam(0.2), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.5)
    ),
}


@pytest.mark.parametrize("name", list(OPTAX_OPTIMIZERS))
def test_any_optax_optimizer_works_in_train_step(name):
    """purejax needs nothing of optax but its calling convention: train_step gives the optimizer the loss as
    `value=` when its update takes it, so even the value-driven transforms step as in optax's loop."""
    optimizer = OPTAX_OPTIMIZERS[name]()
    step = jax.jit(functools.partial(optim.train_step, loss_fn=mse, optimizer=optimizer))
    state = optim.init_train_state(PARAMS, optimizer, jax.random.key(0))
    for _ in range(6):
        state, _ = step(state, BATCH)
    want_params, want_state = optax_loop(optimizer, 6)
    chex.assert_trees_all_close((state.params, state.opt_state), (want_params, want_state), rtol=2e-5, atol=1e-6)
    if "plateau" in name:
        assert float(state.opt_state[1].scale) < 1.0  # the loss reached the plateau rule: value arrived
