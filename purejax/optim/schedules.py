"""Learning-rate schedules: functions from the step count (0 on the first update) to a float32 value.

Pass one wherever a learning rate goes (`adamw(warmup_cosine(6e-4, 2000, 600_000, 6e-5))`). They are plain jnp
functions of a traced count, so one compiled step serves every step of the run. Each matches its optax
namesake where optax has one; `warmup_cosine`'s default start reproduces nanoGPT's `get_lr` exactly, and
`warmup_stable_decay` is the "WSD" schedule of MiniCPM (Hu et al. 2024).
"""

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from purejax.optim.base import Schedule


def _f32(x: ArrayLike) -> Float[Array, "..."]:
    return jnp.asarray(x, jnp.float32)


def _check_steps(name: str, **steps: int) -> None:
    for arg, value in steps.items():
        if value < 0:
            raise ValueError(f"{name}: {arg} must be a non-negative number of steps, got {value}")


def constant(value: ArrayLike) -> Schedule:
    """`value` at every step."""
    return lambda count: _f32(value) + jnp.zeros_like(count, jnp.float32)


def linear(init_value: ArrayLike, end_value: ArrayLike, steps: int, begin: int = 0) -> Schedule:
    """`init_value` until step `begin`, then a straight line to `end_value` over `steps` steps, then
    `end_value` (`optax.linear_schedule`). A linear warmup is `linear(0.0, peak, warmup_steps)`."""
    _check_steps("linear", steps=steps, begin=begin)
    if steps == 0:
        return constant(init_value)

    def schedule(count: ArrayLike) -> Float[Array, "*batch"]:
        fraction = jnp.clip(count - begin, 0, steps) / steps
        return _f32(init_value * (1 - fraction) + end_value * fraction)  # exact at both ends

    return schedule


def cosine_decay(init_value: ArrayLike, decay_steps: int, end_value: ArrayLike = 0.0) -> Schedule:
    """Half a cosine from `init_value` to `end_value` over `decay_steps` steps, then `end_value`: nanoGPT's
    `min_lr + coeff * (learning_rate - min_lr)`, and `optax.cosine_decay_schedule` with `alpha = end / init`."""
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay: decay_steps must be positive, got {decay_steps}")

    def schedule(count: ArrayLike) -> Float[Array, "*batch"]:
        done = jnp.minimum(count, float(decay_steps))
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * done / decay_steps))
        return _f32(end_value + (init_value - end_value) * cosine)

    return schedule


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """`schedules[0]` before `boundaries[0]`, then `schedules[1]` restarted from count 0, and so on
    (`optax.join_schedules`): piece i sees `count - boundaries[i - 1]`."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}"
        )
    if list(boundaries) != sorted(boundaries):
        raise ValueError(f"join: boundaries must be increasing, got {list(boundaries)}")

    def schedule(count: ArrayLike) -> Float[Array, "*batch"]:
        value = _f32(schedules[0](count))
        for boundary, piece in zip(boundaries, schedules[1:]):
            value = jnp.where(count < boundary, value, _f32(piece(count - boundary)))
        return value

    return schedule


def warmup_cosine(
    peak_value: ArrayLike,
    warmup_steps: int,
    decay_steps: int,
    end_value: ArrayLike = 0.0,
    init_value: ArrayLike | None = None,
) -> Schedule:
    """Linear warmup from `init_value` to `peak_value` over `warmup_steps`, then cosine decay to `end_value`
    at step `decay_steps` (counted from 0, warmup included), then `end_value`.

    The default `init_value = peak_value / (warmup_steps + 1)` makes step `it` get exactly nanoGPT's
    `get_lr(it)` with `learning_rate=peak_value, warmup_iters=warmup_steps, lr_decay_iters=decay_steps,
    min_lr=end_value`: `peak * (it + 1) / (warmup + 1)` during warmup, so the first step is not wasted at 0.
    With `init_value=0.0` it is `optax.warmup_cosine_decay_schedule`."""
    _check_steps("warmup_cosine", warmup_steps=warmup_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(f"warmup_cosine: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")
    start = peak_value / (warmup_steps + 1) if init_value is None else init_value
    warmup = linear(start, peak_value, warmup_steps)
    return join([warmup, cosine_decay(peak_value, decay_steps - warmup_steps, end_value)], [warmup_steps])


def warmup_stable_decay(
    peak_value: ArrayLike,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    end_value: ArrayLike = 0.0,
    decay_shape: str = "linear",
) -> Schedule:
    """Warmup-stable-decay: linear warmup from 0 to `peak_value`, hold it for `stable_steps`, then decay to
    `end_value` over `decay_steps` (shape: linear, cosine, or `1 - sqrt(fraction)` as in Hägele et al. 2024),
    then hold `end_value`. The stable phase can be extended, and a decay branched off any checkpoint."""
    _check_steps("warmup_stable_decay", warmup_steps=warmup_steps, stable_steps=stable_steps, decay_steps=decay_steps)
    shapes = {
        "linear": lambda f: 1 - f,
        "cosine": lambda f: 0.5 * (1 + jnp.cos(jnp.pi * f)),
        "sqrt": lambda f: 1 - jnp.sqrt(f),
    }
    if decay_shape not in shapes:
        raise ValueError(f"warmup_stable_decay: decay_shape must be one of {sorted(shapes)}, got {decay_shape!r}")

    def decay(count: ArrayLike) -> Float[Array, "*batch"]:
        fraction = jnp.clip(count / max(decay_steps, 1), 0.0, 1.0)
        return _f32(end_value + (peak_value - end_value) * shapes[decay_shape](fraction))

    last = decay if decay_steps else constant(end_value)  # no decay steps: end_value at once
    pieces = [linear(0.0, peak_value, warmup_steps), constant(peak_value), last]
    return join(pieces, [warmup_steps, warmup_steps + stable_steps])


def one_cycle(
    total_steps: int,
    peak_value: ArrayLike,
    pct_start: ArrayLike = 0.3,
    div_factor: ArrayLike = 25.0,
    final_div_factor: ArrayLike = 1e4,
) -> Schedule:
    """Smith & Topin's one-cycle policy with cosine annealing, as `optax.cosine_onecycle_schedule`: from
    `peak / div_factor` up to `peak` at step `int(pct_start * total_steps)`, then down to
    `peak / (div_factor * final_div_factor)` at step `total_steps`.

    torch's `OneCycleLR` peaks and ends one step earlier (at `pct_start * total_steps - 1` and
    `total_steps - 1`): that schedule is `one_cycle_torch`."""
    if total_steps <= 0:
        raise ValueError(f"one_cycle: total_steps must be positive, got {total_steps}")
    peak_step = int(pct_start * total_steps)
    return _one_cycle(peak_value, div_factor, final_div_factor, peak_step, total_steps, up=max(peak_step, 1))


def one_cycle_torch(
    total_steps: int,
    peak_value: ArrayLike,
    pct_start: ArrayLike = 0.3,
    div_factor: ArrayLike = 25.0,
    final_div_factor: ArrayLike = 1e4,
) -> Schedule:
    """torch's `OneCycleLR(max_lr=peak_value, total_steps=...)` learning rate (cosine annealing, two phases):
    the cosine rises from `peak / div_factor` to `peak` at step `pct_start * total_steps - 1` (a float step, as
    torch computes it) and falls to `peak / (div_factor * final_div_factor)` at step `total_steps - 1`, the
    last step torch allows; held there afterwards. Only the rate: torch also cycles the momentum (Adam's b1)
    unless `cycle_momentum=False`."""
    if total_steps <= 1:
        raise ValueError(f"one_cycle_torch: total_steps must be at least 2, got {total_steps}")
    peak_step = float(pct_start * total_steps) - 1
    return _one_cycle(peak_value, div_factor, final_div_factor, peak_step, total_steps - 1, up=peak_step)


def _one_cycle(
    peak_value: ArrayLike,
    div_factor: ArrayLike,
    final_div_factor: ArrayLike,
    peak_step: float,
    end_step: int,
    up: float,
) -> Schedule:
    """Cosine up from `peak / div_factor` over `up` steps to `peak` at `peak_step`, cosine down to the end value
    at `end_step`, then the end value."""
    start = peak_value / div_factor
    end = start / final_div_factor
    down = max(end_step - peak_step, 1)

    def cosine(a: ArrayLike, b: ArrayLike, fraction: Float[Array, "*batch"]) -> Float[Array, "*batch"]:
        return b + (a - b) / 2.0 * (jnp.cos(jnp.pi * fraction) + 1)

    def schedule(count: ArrayLike) -> Float[Array, "*batch"]:
        count = jnp.asarray(count)
        rising = cosine(start, peak_value, count / up) if up > 0 else peak_value
        falling = cosine(peak_value, end, (count - peak_step) / down)
        value = jnp.where(count < peak_step, rising, jnp.where(count < end_step, falling, end))
        return _f32(value)

    return schedule


def piecewise_constant(init_value: ArrayLike, boundaries_and_scales: Mapping[int, ArrayLike]) -> Schedule:
    """`init_value`, multiplied by `scale` from each boundary step on (`optax.piecewise_constant_schedule`):
    `piecewise_constant(0.1, {30_000: 0.1, 60_000: 0.1})` is torch's `MultiStepLR(gamma=0.1)`."""
    if any(scale < 0 for scale in boundaries_and_scales.values()):
        raise ValueError(f"piecewise_constant: scales must be non-negative, got {dict(boundaries_and_scales)}")
    steps = sorted(boundaries_and_scales.items())

    def schedule(count: ArrayLike) -> Float[Array, "*batch"]:
        value = _f32(init_value) + jnp.zeros_like(count, jnp.float32)
        for boundary, scale in steps:
            value = jnp.where(count < boundary, value, value * scale)
        return value

    return schedule
