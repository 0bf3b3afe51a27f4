"""One training step, all of it in plain sight: gradients (accumulated over micro-batches, loss-scaled), the
non-finite check, clipping, the optimizer update, the parameter average, and the metrics.

    state = init_train_state(params, optimizer, jax.random.key(0), loss_scale=dynamic_loss_scale())
    step = jax.jit(functools.partial(train_step, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0),
                   donate_argnums=0)
    for batch in batches:
        state, metrics = step(state, batch)

`loss_fn(params, batch, key) -> (loss, aux)`: a scalar loss (a mean over the examples, so that micro-batch
accumulation gives the whole batch's gradient) and `aux`, a dict of scalar metrics (`{}` for none) that are
averaged over micro-batches and returned with the step's own metrics. For mixed precision wrap the loss function
with `purejax.precision.with_policy`: parameters stay float32 ("master weights") and so do their gradients.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray

from purejax import tree as tree_lib
from purejax.optim.accumulate import accumulate_gradients
from purejax.optim.base import PyTree, apply_updates
from purejax.optim.clipping import clip_to_norm
from purejax.optim.ema import ParamEMA, ParamEMAState
from purejax.optim.learning_rate import get_learning_rate
from purejax.optim.loss_scale import LossScale, NoLossScale

STEP_METRICS = ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped")


class TrainState(NamedTuple):
    """Everything a training step reads and writes; a plain pytree, checkpointed as it is."""

    params: PyTree
    opt_state: PyTree
    loss_scale: LossScale
    ema: ParamEMAState | None  # the parameter average, if the step keeps one
    step: Int[Array, ""]  # steps taken, skipped ones included
    key: PRNGKeyArray  # split once per step; the step's half goes to loss_fn


def init_train_state(
    params: PyTree,
    optimizer: Any,
    key: PRNGKeyArray,
    *,
    loss_scale: LossScale = NoLossScale(),
    ema: ParamEMA | None = None,
) -> TrainState:
    """The state before the first step. `optimizer` is any gradient transformation (purejax or optax).

    The state holds `params` itself, not a copy: once it is donated to a jitted step, those arrays are gone."""
    ema_state = None if ema is None else ema.init(params)
    return TrainState(params, optimizer.init(params), loss_scale, ema_state, jnp.zeros((), jnp.int32), key)


def train_step(
    state: TrainState,
    batch: PyTree,
    *,
    loss_fn: Callable[[PyTree, PyTree, PRNGKeyArray], tuple[Array, dict[str, Any]]],
    optimizer: Any,
    max_grad_norm: ArrayLike | None = None,
    ema: ParamEMA | None = None,
    micro_batches: int = 1,
    axis_name: Any = None,
    param_specs: PyTree = None,
) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step on `batch`; returns the new state and the metrics.

    Arguments:
        loss_fn: `(params, batch, key) -> (loss, aux)`, see the module docstring.
        optimizer: the gradient transformation whose state is `state.opt_state`.
        max_grad_norm: clip the gradients to this global norm (torch's `clip_grad_norm_`); None: no clipping.
        ema: the parameter average kept in `state.ema` (the same `param_ema` given to `init_train_state`).
        micro_batches: split every batch leaf's leading axis into this many micro-batches and accumulate.
        axis_name: inside `shard_map`, the mesh axes every parameter is sharded over, so that the global norm
            and the finiteness check cover the whole model; or
        param_specs: the `PartitionSpec` of each parameter, when they are sharded differently (tensor
            parallelism, FSDP): each leaf's squares are reduced over its own axes (`purejax.tree.global_norm`).
            Averaging gradients over data-parallel devices is not done here: a loss already averaged over the
            data axis (`purejax.losses.masked_mean(..., axis_name=...)`) has the right gradients under
            `jax.grad` (see purejax/parallel/step.py).

    Metrics: `loss` (unscaled, averaged over micro-batches), `grad_norm` (before clipping), `learning_rate`
    (the rate this step's update used, or on a skipped step the kept state's; absent if the state holds
    none), `loss_scale`, and `skipped`: True when the gradients were not finite, in which case params,
    optimizer state and average are left as they were (the loss scale backs off if it is dynamic). A gradient
    norm that overflows float32 counts as not finite.
    """
    if (ema is None) != (state.ema is None):
        raise ValueError(
            "train_step's `ema` and the state's average must come together: pass the same param_ema to "
            f"init_train_state and train_step (got ema={'None' if ema is None else 'a ParamEMA'}, state.ema="
            f"{'None' if state.ema is None else 'an average'})"
        )
    key, step_key = jax.random.split(state.key)
    grad_fn = jax.grad(functools.partial(_scaled_loss, loss_fn, state.loss_scale), has_aux=True)
    grads, (loss, aux) = accumulate_gradients(grad_fn, state.params, batch, step_key, micro_batches)
    grads = state.loss_scale.unscale(grads)

    grad_norm = tree_lib.global_norm(grads, axis_name, specs=param_specs)
    finite = jnp.isfinite(grad_norm)
    if max_grad_norm is not None:
        grads = clip_to_norm(grads, grad_norm, max_grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = apply_updates(state.params, updates)
    ema_state = None if ema is None else ema.update(state.ema, params)

    def unless_skipped(new: PyTree, old: PyTree) -> PyTree:
        return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)

    new_state = TrainState(
        params=unless_skipped(params, state.params),
        opt_state=unless_skipped(opt_state, state.opt_state),
        loss_scale=state.loss_scale.adjust(finite),
        ema=unless_skipped(ema_state, state.ema),
        step=state.step + 1,
        key=key,
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": state.loss_scale.loss_scale, "skipped": ~finite}
    learning_rate = get_learning_rate(new_state.opt_state)  # a skipped step reports the state it kept
    if learning_rate is not None:
        metrics["learning_rate"] = learning_rate
    return new_state, {**metrics, **aux}


def _scaled_loss(
    loss_fn: Callable, loss_scale: LossScale, params: PyTree, batch: PyTree, key: PRNGKeyArray
) -> tuple[Array, tuple[Array, dict[str, Any]]]:
    """`loss_fn`'s loss times the loss scale (what is differentiated), with the unscaled loss and aux beside it."""
    out = loss_fn(params, batch, key)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        got = "a single array" if hasattr(out, "shape") else type(out).__name__
        raise TypeError(
            f"loss_fn must return (loss, aux) with aux a dict of scalar metrics ({{}} for none), got {got}; "
            "e.g. `return loss, {}`"
        )
    loss, aux = out
    if jnp.shape(loss) != ():
        raise TypeError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}; take the mean over the batch")
    clashes = sorted(set(aux) & set(STEP_METRICS))
    if clashes:
        raise ValueError(f"loss_fn's aux uses the names {clashes}, which train_step reports itself; rename them")
    return loss_scale.scale(loss), (loss, aux)
