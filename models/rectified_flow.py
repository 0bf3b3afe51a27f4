"""Rectified flow (Liu et al. 2022, arXiv:2209.03003), as Stable Diffusion 3 trains it (Esser et al. 2024,
arXiv:2403.03206): the training loss, the time distributions, and an Euler sampler with classifier-free
guidance. Works with any velocity model `velocity(params, z, t, y) -> v`, e.g. `models.dit.velocity`.

The convention here: t = 0 is data and t = 1 is noise,

    z_t = (1 - t) * x + t * eps,      eps ~ N(0, I),
    the model predicts the velocity dz_t/dt = eps - x,
    loss = per-sample mean over pixels of (v(z_t, t, y) - (eps - x))^2, averaged over the batch.

This is SD3's and diffusers' (`FlowMatchEulerDiscreteScheduler`). Liu et al. write the mirror image (t = 0
noise, t = 1 data, velocity data - noise): the same model under t -> 1 - t, v -> -v. Sampling integrates
dz/dt = v from t = 1 (pure noise) down to t = 0 (data).

Time sampling. "uniform": t ~ U(0, 1). "logit_normal": t = sigmoid(m + s * n), n ~ N(0, 1), which puts more
training on the middle times, where predicting the velocity is hardest; SD3 found (m, s) = (0, 1) best among
its variants (sec. 5.1). `shift` > 1 moves every t towards noise, `t -> shift * t / (1 + (shift - 1) * t)`
(SD3 eq. 23, for higher resolutions, whose images stay recognisable at larger noise levels); it is applied
to the sampled training times and to the sampler's time grid alike.

Keys. The time, the noise and the dropped labels each get their own key (`named_keys`): one key reused for
t and for eps would make the noise a function of t (a published JAX port did exactly that), and the model
would then learn that correlation instead of the flow.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Integer, PRNGKeyArray

from purejax import random as prandom

Velocity = Callable[[Any, Array, Array, Array], Array]  # (params, z, t, y) -> v, v shaped as z


@dataclass(frozen=True)
class FlowConfig:
    """How training times and labels are drawn. Frozen and hashable (a static jit argument).

    Arguments:
        time_sampling: "uniform" or "logit_normal" (SD3's choice).
        logit_mean, logit_std: m and s of the logit-normal.
        shift: the resolution shift (1: none), applied after sampling t; see the module docstring.
        label_dropout: probability that a training label is replaced by the null class, which teaches the
            unconditional velocity classifier-free guidance needs (DiT and SD3: 0.1).
        null_class: the label id meaning "no label" (`DiTConfig.null_class`, i.e. n_classes). Required.
    """

    null_class: int  # no default: a wrong one silently trains a real class (or NaN) as "no label"
    time_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    label_dropout: float = 0.1

    def __post_init__(self):
        if self.time_sampling not in ("uniform", "logit_normal"):
            raise ValueError(
                f"FlowConfig: time_sampling must be 'uniform' or 'logit_normal', got {self.time_sampling!r}"
            )
        if not (self.logit_std > 0 and self.shift > 0 and math.isfinite(self.logit_mean)):  # NaN fails too
            raise ValueError(
                f"FlowConfig: logit_std and shift must be positive and logit_mean finite, got "
                f"{self.logit_std}, {self.shift}, {self.logit_mean}"
            )
        if not 0.0 <= self.label_dropout <= 1.0:
            raise ValueError(f"FlowConfig: label_dropout must be in [0, 1], got {self.label_dropout}")
        if isinstance(self.null_class, bool) or not isinstance(self.null_class, int) or self.null_class < 0:
            raise ValueError(f"FlowConfig: null_class must be an int >= 0, got {self.null_class!r}")


# ---------------------------------------------------------------- training


def shift_time(t: Float[ArrayLike, "*shape"], shift: float) -> Float[Array, "*shape"]:
    """shift * t / (1 + (shift - 1) * t): fixes 0 and 1, moves the rest towards 1 (noise) when shift > 1."""
    t = jnp.asarray(t)
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def sample_time(key: PRNGKeyArray, batch: int, config: FlowConfig) -> Float[Array, " batch"]:
    """`batch` training times in (0, 1), float32, from `config.time_sampling`, then shifted."""
    if config.time_sampling == "uniform":
        t = jax.random.uniform(key, (batch,), jnp.float32)
    else:
        t = jax.nn.sigmoid(config.logit_mean + config.logit_std * jax.random.normal(key, (batch,), jnp.float32))
    return shift_time(t, config.shift)


def interpolate(
    x: Float[Array, " batch *shape"], eps: Float[Array, " batch *shape"], t: Float[Array, " batch"]
) -> Float[Array, " batch *shape"]:
    """z_t = (1 - t) * x + t * eps, t broadcast over each sample's pixels."""
    t = t.reshape(-1, *([1] * (x.ndim - 1))).astype(x.dtype)
    return (1 - t) * x + t * eps


def drop_labels(
    key: PRNGKeyArray, y: Integer[Array, " batch"], rate: float, null_class: int
) -> Integer[Array, " batch"]:
    """Each label replaced by `null_class` with probability `rate`. A sampler: like jax.random's, it takes its
    key first."""
    return jnp.where(jax.random.bernoulli(key, rate, y.shape), jnp.asarray(null_class, y.dtype), y)


def per_sample_loss(
    v: Float[Array, " batch *shape"],
    x: Float[Array, " batch *shape"],
    eps: Float[Array, " batch *shape"],
    kept: Bool[Array, " batch *mask_shape"] | None = None,
) -> Float[Array, " batch"]:
    """Mean of (v - (eps - x))^2 over each sample's elements, in float32. With `kept` (broadcastable to v,
    e.g. MicroDiT's kept patches), only kept elements count, and the mean is over them."""
    err = jnp.square(v.astype(jnp.float32) - (eps.astype(jnp.float32) - x.astype(jnp.float32)))
    axes = tuple(range(1, v.ndim))
    if kept is None:
        return jnp.mean(err, axis=axes)
    kept = jnp.broadcast_to(kept, v.shape)
    return jnp.sum(jnp.where(kept, err, 0.0), axis=axes) / jnp.maximum(jnp.sum(kept, axis=axes), 1)


def loss(
    predict: Callable[..., Any],
    params: Any,
    x: Float[Array, " batch *shape"],
    y: Integer[Array, " batch"],
    config: FlowConfig,
    *,
    key: PRNGKeyArray,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The rectified-flow loss of a batch of data `x` with labels `y`, and `{"t_mean": mean t}`.

    `predict(params, z, t, y, *, key)` returns the velocity, or `(velocity, kept)` for a model that sees only
    part of its input (`models.dit.apply_masked`); `key` is its own (masking, dropout). The key is split by
    name into "time", "noise", "labels" and "model", so that no two draws share one."""
    keys = prandom.named_keys(key, "time", "noise", "labels", "model")
    t = sample_time(keys["time"], x.shape[0], config)
    eps = jax.random.normal(keys["noise"], x.shape, x.dtype)
    y = drop_labels(keys["labels"], y, config.label_dropout, config.null_class)
    out = predict(params, interpolate(x, eps, t), t, y, key=keys["model"])
    v, kept = out if isinstance(out, tuple) else (out, None)
    if v.shape != x.shape:
        raise ValueError(
            f"rectified_flow.loss: predict returned shape {v.shape}, expected x's {x.shape}; a "
            f"model with learned sigma must return only the velocity channels "
            f"(models.dit.velocity)"
        )
    return jnp.mean(per_sample_loss(v, x, eps, kept)), {"t_mean": jnp.mean(t)}


# ---------------------------------------------------------------- sampling


def time_grid(n_steps: int, shift: float = 1.0) -> Float[Array, " n_steps_plus_1"]:
    """n_steps + 1 times from 1 (noise) down to 0 (data), evenly spaced before the shift."""
    return shift_time(jnp.linspace(1.0, 0.0, n_steps + 1, dtype=jnp.float32), shift)


def guided_velocity(
    velocity: Velocity,
    params: Any,
    z: Float[Array, " batch *shape"],
    t: Float[Array, " batch"],
    y: Integer[Array, " batch"],
    guidance: Float[ArrayLike, ""],
    null_class: int,
) -> Float[Array, " batch *shape"]:
    """Classifier-free guidance on the velocity: v_null + guidance * (v_y - v_null) (Ho & Salimans 2022).
    guidance 1 is the plain conditional velocity, 0 the unconditional one. Both velocities come from one
    call on the doubled batch."""
    v = velocity(
        params, jnp.concatenate([z, z]), jnp.concatenate([t, t]), jnp.concatenate([y, jnp.full_like(y, null_class)])
    )
    v_cond, v_null = jnp.split(v, 2)
    return v_null + jnp.asarray(guidance, v.dtype) * (v_cond - v_null)


def sample(
    velocity: Velocity,
    params: Any,
    key: PRNGKeyArray,
    y: Integer[ArrayLike, " batch"],
    *,
    shape: tuple[int, ...],
    n_steps: int,
    guidance: Float[ArrayLike, ""] = 1.0,
    null_class: int,
    shift: float = 1.0,
) -> Float[Array, " batch *shape"]:
    """Samples for labels `y`: noise drawn from `key`, integrated by Euler's method from t = 1 to t = 0 in
    `n_steps` steps, z <- z + (t_next - t) * v(z, t), with guidance on the velocity.

    The steps run under `lax.scan`, so the velocity is traced once whatever n_steps. Jit it with the
    static arguments bound, e.g. `jax.jit(functools.partial(sample, velocity, shape=..., n_steps=8,
    null_class=10))`: one compilation per n_steps and batch size; the key, labels, guidance and params
    are ordinary (traced) arguments."""
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"rectified_flow.sample: n_steps must be a positive int, got {n_steps!r}")
    y = jnp.asarray(y)
    if y.ndim != 1 or not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(
            f"rectified_flow.sample: y must be a 1-D array of integer labels, got {y.dtype}{list(y.shape)}"
        )
    ts = time_grid(n_steps, shift)
    batch = y.shape[0]

    def step(z, i):
        t = jnp.full((batch,), ts[i])
        v = guided_velocity(velocity, params, z, t, y, guidance, null_class)
        return z + (ts[i + 1] - ts[i]).astype(z.dtype) * v, None

    noise = jax.random.normal(key, (batch, *shape), jnp.float32)
    z, _ = jax.lax.scan(step, noise, jnp.arange(n_steps))
    return z
