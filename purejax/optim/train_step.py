"""One training step, all of it in plain sight: gradients (accumulated over micro-batches, loss-scaled), the
non-finite check, clipping, the optimizer update, the parameter average, the model's own state, and the metrics.

    state = init_train_state(params, optimizer, jax.random.key(0), loss_scale=dynamic_loss_scale())
    step = jax.jit(functools.partial(train_step, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1.0),
                   donate_argnums=0)
    for batch in batches:
        state, metrics = step(state, batch)

`loss_fn(params, batch, key) -> (loss, aux)`: a scalar loss (a mean over the examples, so that micro-batch
accumulation gives the whole batch's gradient) and `aux`, a dict of scalar metrics (`{}` for none), returned
with the step's own metrics. For mixed precision wrap the loss function with `purejax.precision.with_policy`:
parameters stay float32 ("master weights") and so do their gradients.

A model with state of its own (BatchNorm's running statistics) keeps it in `TrainState.model_state`, given to
`init_train_state(..., model_state=...)`. The step then calls

    loss_fn(params, model_state, batch, key) -> (loss, (aux, new_model_state))

(the form follows the state: a state with a model_state always gets this call, one without never does).
With micro-batches, the statistics update once per step, not once per micro-batch: every micro-batch starts
from the step's model_state, as every device does in data parallelism, and the new state is the mean of the
micro-batches' (floating leaves; an integer leaf, such as a counter, is the last micro-batch's). For running
means of equal micro-batches that is exactly the whole batch's update. On a skipped step (non-finite
gradients) the model_state is kept, as the params are.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray

from purejax import tree as tree_lib
from purejax.optim.accumulate import accumulate_gradients
from purejax.optim.base import PyTree, apply_updates, extra_args_for
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
    # The model's own state (BatchNorm statistics); None (no leaves: a checkpoint from before the field loads
    # into a stateless state unchanged) when the model has none.
    model_state: PyTree = None


def init_train_state(
    params: PyTree,
    optimizer: Any,
    key: PRNGKeyArray,
    *,
    loss_scale: LossScale = NoLossScale(),
    ema: ParamEMA | None = None,
    model_state: PyTree = None,
) -> TrainState:
    """The state before the first step. `optimizer` is any gradient transformation (purejax or optax);
    `model_state` the model's initial state, if it has one (then `loss_fn` takes and returns it).

    The state holds `params` and `model_state` themselves, not copies: once it is donated to a jitted step,
    those arrays are gone."""
    ema_state = None if ema is None else ema.init(params)
    step = jnp.zeros((), jnp.int32)
    return TrainState(params, optimizer.init(params), loss_scale, ema_state, step, key, model_state)


def train_step(
    state: TrainState,
    batch: PyTree,
    *,
    loss_fn: Callable[..., tuple[Array, Any]],
    optimizer: Any,
    max_grad_norm: ArrayLike | None = None,
    ema: ParamEMA | None = None,
    micro_batches: int = 1,
    axis_name: Any = None,
    param_specs: PyTree = None,
    grad_reduce: Callable[[PyTree], PyTree] | None = None,
    local_params: Callable[[PyTree], PyTree] | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step on `batch`; returns the new state and the metrics.

    Arguments:
        loss_fn: `(params, batch, key) -> (loss, aux)`, or with a model state
            `(params, model_state, batch, key) -> (loss, (aux, model_state))`; see the module docstring.
        optimizer: the gradient transformation whose state is `state.opt_state`. Its update is called as
            `update(grads, opt_state, params, value=loss)` when it accepts `value` (optax's convention for the
            objective, e.g. `optax.contrib.reduce_on_plateau`): `value` is the step's loss, `metrics["loss"]`.
        max_grad_norm: clip the gradients to this global norm (torch's `clip_grad_norm_`); None: no clipping.
        ema: the parameter average kept in `state.ema` (the same `param_ema` given to `init_train_state`).
        micro_batches: split every batch leaf's leading axis into this many micro-batches and accumulate.
        axis_name: inside `shard_map`, the mesh axes every parameter is sharded over, so that the global norm
            and the finiteness check cover the whole model; or
        param_specs: the `PartitionSpec` of each parameter, when they are sharded differently (tensor
            parallelism, FSDP): each leaf's squares are reduced over its own axes (`purejax.tree.global_norm`).
        grad_reduce: a function applied once per step to the accumulated, unscaled gradients, before the norm:
            the place for a data-parallel `psum` of the gradients (once per step, whatever `micro_batches`).
        local_params: makes the params `loss_fn` is differentiated at from `state.params` (default: those
            themselves; the update always applies to `state.params`). `purejax.parallel.sharded_train_step`
            gives each data shard its own copy here, so that its gradients stay local until `grad_reduce`.

    Metrics: `loss` (unscaled, averaged over micro-batches), `grad_norm` (before clipping), `learning_rate`
    (the rate this step's update used, or on a skipped step the kept state's; absent if the state holds
    none), `loss_scale`, and `skipped`: True when the gradients were not finite, in which case params,
    optimizer state, average and model state are left as they were (the loss scale backs off if it is
    dynamic). A gradient norm that overflows float32 counts as not finite. `aux` metrics are averaged over
    micro-batches (an integer one is the last micro-batch's).
    """
    _check_ema(ema, state.ema)
    _check_signature(loss_fn, stateful=state.model_state is not None)
    key, step_key = jax.random.split(state.key)
    loss_with_scale = functools.partial(_scaled_loss, loss_fn, state.loss_scale, state.model_state)
    grad_fn = jax.grad(loss_with_scale, has_aux=True)
    at = state.params if local_params is None else local_params(state.params)  # where the gradients are taken
    grads, (loss, aux, model_state) = accumulate_gradients(grad_fn, at, batch, step_key, micro_batches)
    grads = state.loss_scale.unscale(grads)
    if grad_reduce is not None:
        grads = grad_reduce(grads)

    grad_norm = tree_lib.global_norm(grads, axis_name, specs=param_specs)
    finite = jnp.isfinite(grad_norm)
    if max_grad_norm is not None:
        grads = clip_to_norm(grads, grad_norm, max_grad_norm)
    extra_args = extra_args_for(optimizer.update, {"value": loss})
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params, **extra_args)
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
        model_state=unless_skipped(model_state, state.model_state),
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": state.loss_scale.loss_scale, "skipped": ~finite}
    learning_rate = get_learning_rate(new_state.opt_state)  # a skipped step reports the state it kept
    if learning_rate is not None:
        metrics["learning_rate"] = learning_rate
    return new_state, {**metrics, **aux}


def _check_ema(ema: ParamEMA | None, ema_state: ParamEMAState | None) -> None:
    if (ema is None) != (ema_state is None):
        raise ValueError(
            "train_step's `ema` and the state's average must come together: pass the same param_ema to "
            f"init_train_state and train_step (got ema={'None' if ema is None else 'a ParamEMA'}, state.ema="
            f"{'None' if ema_state is None else 'an average'})"
        )


def _check_signature(loss_fn: Callable, stateful: bool) -> None:
    """A loss_fn that cannot take the arguments the state calls for is named before it is called."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a callable without a readable signature: let the call speak
        return
    try:
        signature.bind(*range(4 if stateful else 3))
    except TypeError as e:
        if stateful:
            raise TypeError(
                "the TrainState has a model_state, so loss_fn is called as loss_fn(params, model_state, batch, "
                f"key) and must return (loss, (aux, new_model_state)); {loss_fn!r} cannot take that: {e}"
            ) from None
        raise TypeError(
            f"loss_fn is called as loss_fn(params, batch, key); {loss_fn!r} cannot take that: {e}. A loss_fn "
            "that takes a model_state needs init_train_state(..., model_state=...)"
        ) from None


def _scaled_loss(
    loss_fn: Callable, loss_scale: LossScale, model_state: PyTree, params: PyTree, batch: PyTree, key: PRNGKeyArray
) -> tuple[Array, tuple[Array, dict[str, Any], PyTree]]:
    """`loss_fn`'s loss times the loss scale (what is differentiated), with the unscaled loss, aux and the new
    model state beside it."""
    if model_state is None:
        loss, aux = _unpack(loss_fn(params, batch, key), stateful=False)
        new_model_state = None
    else:
        loss, (aux, new_model_state) = _unpack(loss_fn(params, model_state, batch, key), stateful=True)
        tree_lib.assert_like(new_model_state, model_state, "the model_state loss_fn returned")
    if jnp.shape(loss) != ():
        raise TypeError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}; take the mean over the batch")
    clashes = sorted(set(aux) & set(STEP_METRICS))
    if clashes:
        raise ValueError(f"loss_fn's aux uses the names {clashes}, which train_step reports itself; rename them")
    return loss_scale.scale(loss), (loss, aux, new_model_state)


def _unpack(out: Any, stateful: bool) -> tuple[Array, Any]:
    """`(loss, aux)` or `(loss, (aux, model_state))`, checked against the form the state calls for."""
    pair = isinstance(out, tuple) and len(out) == 2
    with_state = pair and isinstance(out[1], tuple) and len(out[1]) == 2 and isinstance(out[1][0], dict)
    if stateful and not with_state:
        raise TypeError(
            "the TrainState has a model_state, so loss_fn must return (loss, (aux, new_model_state)) with aux a "
            "dict of scalar metrics; e.g. `return loss, ({}, new_state)`"
        )
    if not stateful and with_state:
        raise TypeError(
            "loss_fn returned (loss, (aux, model_state)), but the TrainState has no model_state: give the "
            "initial one to init_train_state(..., model_state=...) so the step threads it through"
        )
    if not stateful and not (pair and isinstance(out[1], dict)):
        got = "a single array" if hasattr(out, "shape") else type(out).__name__
        raise TypeError(
            f"loss_fn must return (loss, aux) with aux a dict of scalar metrics ({{}} for none), got {got}; "
            "e.g. `return loss, {}`"
        )
    return out
