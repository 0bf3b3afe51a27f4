"""purejax.optim.ema: the parameter average against optax.ema (debiased) and float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purejax import optim

STEPS = 100
RNG = np.random.default_rng(0)
SEQUENCE = {"w": RNG.normal(size=(STEPS, 4, 3)).astype(np.float32), "b": RNG.normal(size=(STEPS, 3)).astype(np.float32)}


@functools.partial(jax.jit, static_argnums=(0, 1))
def run_ours(debias, warmup, decay, sequence):
    ema = optim.param_ema(optim.ema_warmup(decay) if warmup else decay, debias=debias)
    first = jax.tree_util.tree_map(lambda x: x[0], sequence)

    def body(state, params):
        state = ema.update(state, params)
        return state, ema.value(state)

    return jax.lax.scan(body, ema.init(first), sequence)[1]


@jax.jit
def run_optax(decay, sequence):
    tx = optax.ema(decay, debias=True)
    first = jax.tree_util.tree_map(lambda x: x[0], sequence)
    return jax.lax.scan(lambda s, p: tx.update(p, s)[::-1], tx.init(first), sequence)[1]


@settings(max_examples=15, deadline=None)
@given(decay=st.floats(0.5, 0.9999))
def test_debiased_average_matches_optax_ema_of_the_params(close, decay):
    decay = jnp.float32(decay)
    close(run_ours(True, False, decay, SEQUENCE), run_optax(decay, SEQUENCE))


def reference(decays, start):
    average = {
        k: v[0].astype(np.float64) if start == "params" else np.zeros_like(v[0], np.float64)
        for k, v in SEQUENCE.items()
    }
    out = []
    for t, d in enumerate(decays):
        average = {k: (1 - d) * SEQUENCE[k][t] + d * a for k, a in average.items()}
        out.append(average)
    return {k: np.stack([o[k] for o in out]) for k in SEQUENCE}


@settings(max_examples=10, deadline=None)
@given(decay=st.floats(0.5, 0.999))
def test_average_from_the_initial_params_matches_float64(close, decay):
    decay32 = float(np.float32(decay))
    close(run_ours(False, False, jnp.float32(decay), SEQUENCE), reference([decay32] * STEPS, "params"), rtol=1e-5)


def test_warmup_decay_matches_float64(close):
    decays = [min(np.float32(0.99), (1 + t) / (10 + t)) for t in range(STEPS)]
    close(run_ours(False, True, jnp.float32(0.99), SEQUENCE), reference(decays, "params"), rtol=1e-5)


def test_debiasing_needs_a_constant_decay():
    with pytest.raises(ValueError, match="debias=True.*constant decay"):
        optim.param_ema(optim.ema_warmup(0.999), debias=True)


def test_a_bfloat16_average_is_kept_in_float32_so_it_moves():
    """In bfloat16, 0.999 * a + 0.001 * p rounds back to a; the default average is float32 and follows p."""
    ema = optim.param_ema(0.999)
    update = jax.jit(ema.update)
    state = ema.init({"w": jnp.ones(2, jnp.bfloat16), "step": jnp.zeros((), jnp.int32)})
    assert state.average["w"].dtype == jnp.float32 and state.average["step"].dtype == jnp.int32
    for _ in range(2000):
        state = update(state, {"w": jnp.full(2, 2.0, jnp.bfloat16), "step": jnp.zeros((), jnp.int32)})
    np.testing.assert_allclose(ema.value(state)["w"], 2 - 0.999**2000, rtol=1e-3)  # 1.865


def test_a_debiased_average_before_any_update_is_not_nan():
    ema = optim.param_ema(0.9, debias=True)
    assert not np.isnan(np.asarray(ema.value(ema.init({"w": jnp.ones(3)}))["w"])).any()


def test_average_dtype_can_be_wider_than_the_params():
    ema = optim.param_ema(0.9, dtype=jnp.float32)
    state = ema.update(ema.init({"w": jnp.ones(3, jnp.bfloat16)}), {"w": jnp.zeros(3, jnp.bfloat16)})
    assert state.average["w"].dtype == jnp.float32 and int(state.count) == 1
    np.testing.assert_allclose(ema.value(state)["w"], 0.9, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("decay", [0.99, optim.ema_warmup(0.99)], ids=["float", "schedule"])
def test_the_average_of_16_bit_params_is_computed_in_float32(dtype, decay):
    """A weakly typed `1 - d` times a 16-bit param rounds the product in 16 bits (0.01 -> 0.010009765625 in
    bfloat16): 100,000 updates of a constant 1.0 then settle at 1.00097 instead of 1.0."""
    ema = optim.param_ema(decay)
    params = {"w": jnp.ones(3, dtype)}
    run = jax.jit(lambda state: jax.lax.fori_loop(0, 100_000, lambda i, s: ema.update(s, params), state))
    state = run(ema.init(params))
    assert state.average["w"].dtype == jnp.float32
    np.testing.assert_allclose(ema.value(state)["w"], 1.0, rtol=1e-6)
