"""purejax.optim.schedules: every schedule against optax's namesake, nanoGPT's get_lr and float64 references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from purejax.optim import schedules

COUNTS = np.arange(0, 400, dtype=np.int32)
rates = st.floats(1e-5, 1.0)
fractions = st.floats(0.0, 1.0, allow_subnormal=False)  # XLA:CPU flushes subnormal float32 to zero


def close(ours, reference, rtol=1e-6):
    got = np.asarray(ours(jnp.asarray(COUNTS)), np.float64)
    want = np.asarray(reference, np.float64)
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


def optax_values(schedule):
    return jax.vmap(schedule)(jnp.asarray(COUNTS))


@settings(max_examples=15, deadline=None)
@given(init=rates, end=rates, steps=st.integers(0, 300), begin=st.integers(0, 100))
def test_linear_matches_optax(init, end, steps, begin):
    close(schedules.linear(init, end, steps, begin), optax_values(optax.linear_schedule(init, end, steps, begin)))


@settings(max_examples=15, deadline=None)
@given(init=rates, end_fraction=fractions, steps=st.integers(1, 500))
def test_cosine_decay_matches_optax(init, end_fraction, steps):
    reference = optax.cosine_decay_schedule(init, steps, alpha=end_fraction)
    close(schedules.cosine_decay(init, steps, init * end_fraction), optax_values(reference))


@settings(max_examples=15, deadline=None)
@given(start=rates, peak=rates, end_fraction=fractions, warmup=st.integers(0, 100), decay=st.integers(1, 300))
def test_warmup_cosine_matches_optax(start, peak, end_fraction, warmup, decay):
    ours = schedules.warmup_cosine(peak, warmup, warmup + decay, peak * end_fraction, init_value=start)
    theirs = optax.warmup_cosine_decay_schedule(start, peak, warmup, warmup + decay, peak * end_fraction)
    close(ours, optax_values(theirs))


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT train.py's get_lr (karpathy/nanoGPT, 2024), in float64."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@settings(max_examples=15, deadline=None)
@given(lr=rates, min_fraction=fractions, warmup=st.integers(0, 100), decay=st.integers(1, 300))
def test_warmup_cosine_default_start_is_nanogpt_get_lr(lr, min_fraction, warmup, decay):
    reference = [nanogpt_get_lr(int(it), lr, warmup, warmup + decay, lr * min_fraction) for it in COUNTS]
    close(schedules.warmup_cosine(lr, warmup, warmup + decay, lr * min_fraction), reference)


def test_nanogpt_shakespeare_config_values():
    """The values nanoGPT's shakespeare-char config uses at a few steps (lr 1e-3, warmup 100, decay 5000)."""
    schedule = schedules.warmup_cosine(1e-3, 100, 5000, 1e-4)
    for it in (0, 50, 99, 100, 2550, 5000, 6000):
        np.testing.assert_allclose(float(schedule(it)), nanogpt_get_lr(it, 1e-3, 100, 5000, 1e-4), rtol=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    peak=rates,
    total=st.integers(1, 400),
    pct=st.floats(0.05, 0.95),
    div=st.floats(2.0, 100.0),
    final=st.floats(1.0, 1e4),
)
def test_one_cycle_matches_optax_cosine_onecycle(peak, total, pct, div, final):
    reference = optax.cosine_onecycle_schedule(total, peak, pct, div, final)
    close(schedules.one_cycle(total, peak, pct, div, final), optax_values(reference), rtol=2e-6)


def torch_one_cycle_lr(step, total_steps, max_lr, pct_start, div_factor, final_div_factor):
    """torch.optim.lr_scheduler.OneCycleLR's get_lr (anneal_strategy="cos", three_phase=False, torch 2.x) at
    `step` (torch's last_epoch: 0 before the first scheduler.step()), in float64."""
    initial_lr = max_lr / div_factor
    phases = [
        (float(pct_start * total_steps) - 1, initial_lr, max_lr),
        (total_steps - 1, max_lr, initial_lr / final_div_factor),
    ]
    start_step = 0.0
    for i, (end_step, start_lr, end_lr) in enumerate(phases):
        if step <= end_step or i == len(phases) - 1:
            pct = (step - start_step) / (end_step - start_step)
            return end_lr + (start_lr - end_lr) / 2.0 * (math.cos(math.pi * pct) + 1)
        start_step = end_step


@settings(max_examples=15, deadline=None)
@given(
    peak=rates,
    total=st.integers(2, 400),
    pct=st.floats(0.05, 0.95),
    div=st.floats(2.0, 100.0),
    final=st.floats(1.0, 1e4),
)
def test_one_cycle_torch_matches_torch_one_cycle_lr(peak, total, pct, div, final):
    assume(pct * total > 1)  # else torch divides by the zero-length first phase at step 0
    steps = COUNTS[COUNTS < total]  # torch refuses to step past total_steps; ours holds the end value
    want = [torch_one_cycle_lr(int(s), total, peak, pct, div, final) for s in steps]
    got = np.asarray(schedules.one_cycle_torch(total, peak, pct, div, final)(jnp.asarray(steps)), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * peak)


def test_one_cycle_torch_peaks_and_ends_one_step_before_optax():
    """total_steps=100, pct_start=0.3: torch peaks at step 29 and ends at 99, optax at 30 and 100."""
    torch_like, optax_like = schedules.one_cycle_torch(100, 1.0), schedules.one_cycle(100, 1.0)
    assert float(torch_like(29)) == 1.0 and float(optax_like(30)) == 1.0 and float(optax_like(29)) < 1.0
    np.testing.assert_allclose(float(torch_like(99)), 1 / 25 / 1e4, rtol=1e-6)
    assert float(optax_like(99)) > 1e-5 > 1 / 25 / 1e4


@settings(max_examples=15, deadline=None)
@given(
    init=rates,
    table=st.dictionaries(st.integers(0, 399), st.floats(0.0, 2.0), max_size=4),
)
def test_piecewise_constant_matches_optax(init, table):
    close(schedules.piecewise_constant(init, table), optax_values(optax.piecewise_constant_schedule(init, table)))


@settings(max_examples=10, deadline=None)
@given(a=rates, b=rates, c=rates, first=st.integers(0, 150), second=st.integers(0, 150))
def test_join_matches_optax(a, b, c, first, second):
    ours = schedules.join(
        [schedules.constant(a), schedules.linear(b, c, 50), schedules.cosine_decay(c, 70)], [first, first + second]
    )
    theirs = optax.join_schedules(
        [optax.constant_schedule(a), optax.linear_schedule(b, c, 50), optax.cosine_decay_schedule(c, 70)],
        [first, first + second],
    )
    close(ours, optax_values(theirs))


def wsd_reference(it, peak, warmup, stable, decay, end, shape):
    """Warmup-stable-decay in float64, written from the description in Hu et al. 2024 / Hägele et al. 2024."""
    if it < warmup:
        return peak * it / warmup
    if it < warmup + stable:
        return peak
    fraction = min((it - warmup - stable) / decay, 1.0) if decay else 1.0  # no decay steps: at end_value at once
    weight = {
        "linear": 1 - fraction,
        "cosine": 0.5 * (1 + math.cos(math.pi * fraction)),
        "sqrt": 1 - math.sqrt(fraction),
    }
    return end + (peak - end) * weight[shape]


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
@settings(max_examples=10, deadline=None)
@given(
    peak=rates,
    end_fraction=st.floats(0.0, 0.5),
    warmup=st.integers(0, 100),
    stable=st.integers(0, 150),
    decay=st.integers(0, 150),
)
def test_warmup_stable_decay_matches_float64(shape, peak, end_fraction, warmup, stable, decay):
    reference = [wsd_reference(int(it), peak, warmup, stable, decay, peak * end_fraction, shape) for it in COUNTS]
    close(schedules.warmup_stable_decay(peak, warmup, stable, decay, peak * end_fraction, shape), reference)


def test_warmup_stable_decay_without_decay_steps_drops_at_once():
    schedule = schedules.warmup_stable_decay(1.0, 2, 2, 0, end_value=0.1)
    np.testing.assert_allclose(schedule(jnp.arange(6)), [0.0, 0.5, 1.0, 1.0, 0.1, 0.1], rtol=1e-6)


def test_constant_is_constant_and_float32():
    values = schedules.constant(3e-4)(jnp.asarray(COUNTS))
    assert values.dtype == jnp.float32 and values.shape == COUNTS.shape
    np.testing.assert_array_equal(values, np.float32(3e-4))


def test_schedules_work_on_a_traced_count():
    schedule = schedules.warmup_stable_decay(1.0, 10, 10, 10, decay_shape="cosine")
    np.testing.assert_allclose(jax.jit(schedule)(jnp.int32(25)), 0.5 * (1 + math.cos(math.pi * 0.5)), rtol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="2 schedules need 1 boundaries, got 2"):
        schedules.join([schedules.constant(1.0)] * 2, [1, 2])
    with pytest.raises(ValueError, match="boundaries must be increasing"):
        schedules.join([schedules.constant(1.0)] * 3, [5, 2])
    with pytest.raises(ValueError, match=r"decay_steps \(10\) must exceed warmup_steps \(10\)"):
        schedules.warmup_cosine(1.0, 10, 10)
    with pytest.raises(ValueError, match="decay_shape must be one of"):
        schedules.warmup_stable_decay(1.0, 1, 1, 1, decay_shape="exp")
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative"):
        schedules.warmup_stable_decay(1.0, -1, 1, 1)
    with pytest.raises(ValueError, match="scales must be non-negative"):
        schedules.piecewise_constant(1.0, {10: -0.1})
