"""What `python -m train.gpt` runs each step, on the devices it was given: the optimizer and the state before
the first step, the loss (gpt_parallel's, or with `--pp` the pipelined one of models/gpt_pipeline.py), the
params' layout, the training step and the evaluation loss.

    state = new_state(settings, model_config)
    param_specs = model_specs(model_config, devices)          # None on one device
    step_fn, eval_loss = compile_step(settings, model_config, devices, state_specs, param_specs)

With `--pp` the training step is the ordinary `sharded_train_step`: the pipelined loss is a `jax.custom_vjp`
whose gradient is the one the schedule computed, so loss scaling, gradient accumulation, clipping, the
optimizer and the data-parallel gradient sum run unchanged. Evaluation runs the pipeline's forwards alone on
the params where they lie (each stage its own layers), with no gather.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models import gpt, gpt_moe, gpt_parallel, gpt_pipeline
from purejax import optim
from purejax.parallel import MeshAxes, pipeline, pipeline_schedules
from purejax.precision import Policy, with_policy
from train.gpt_settings import GPTSettings
from train.kit.devices import Devices

decays = optim.ndim_at_least(2, stacked=("blocks",))
"""nanoGPT's rule: weight decay on tensors with ndim >= 2 (matmul weights and embeddings), not on biases or
LayerNorm scales; counted per layer, so the stacked blocks' leading layer axis does not count."""


def make_optimizer(settings: GPTSettings, data_axis: str | None = None) -> optim.GradientTransformation:
    """`settings.optimizer` with weight decay where `decays` says, driven by nanoGPT's warmup + cosine schedule (or a
    constant rate): AdamW; Shampoo, its step size grafted from Adam's, each layer of the stacked blocks with
    its own statistics; or Muon on the blocks' matrices and AdamW on the rest (the embeddings, which are also
    the head, the biases and norms: Keller Jordan's split), its update scaled to AdamW's RMS (`muon_rms`).
    Inside the data-parallel step, `data_axis` shares Shampoo's inverse roots out over the data shards (each
    computes its share, one all-gather joins them) instead of every shard computing all of them."""
    if settings.decay_lr:
        lr = optim.schedules.warmup_cosine(
            settings.learning_rate, settings.warmup_iters, settings.lr_decay_iters, settings.min_lr
        )
    else:
        lr = settings.learning_rate
    if settings.optimizer == "shampoo":
        return optim.shampoo(
            lr,
            settings.shampoo_block_size,
            b1=settings.beta1,
            b2=settings.beta2,
            stacked=("blocks",),
            precondition_every=settings.shampoo_precondition_every,
            start_preconditioning_step=settings.shampoo_start,
            axis_name=data_axis,
            weight_decay=settings.weight_decay,
            mask=decays,
        )
    if settings.optimizer == "muon":
        matrices = optim.matrix_leaves(stacked=("blocks",), exclude=("wte", "wpe"))
        return optim.muon(
            lr,
            ns_steps=settings.muon_ns_steps,
            beta=settings.muon_momentum,
            weight_decay=settings.weight_decay,
            weight_decay_mask=decays,
            adam_b1=settings.beta1,
            adam_b2=settings.beta2,
            adam_weight_decay=settings.weight_decay,
            adam_weight_decay_mask=decays,
            matrices=matrices,
            consistent_rms=settings.muon_rms,
        )
    return optim.adamw(lr, b1=settings.beta1, b2=settings.beta2, weight_decay=settings.weight_decay, mask=decays)


def new_state(
    settings: GPTSettings, model_config: gpt.GPTConfig, params: dict | None = None, dtype: str = ""
) -> optim.TrainState:
    """The state before the first step: `params` (default: `gpt.init`), AdamW's state, the key, and the dynamic
    loss scale that float16 needs (for `dtype`, default the run's)."""
    key = jax.random.key(settings.seed)
    params = gpt.init(jax.random.fold_in(key, 0), model_config) if params is None else params
    loss_scale = optim.dynamic_loss_scale() if (dtype or settings.dtype) == "float16" else optim.NoLossScale()
    return optim.init_train_state(params, make_optimizer(settings), jax.random.fold_in(key, 1), loss_scale=loss_scale)


def model_loss(model_config: gpt.GPTConfig, axes: MeshAxes, table: pipeline_schedules.Table | None = None) -> Callable:
    """`(params, batch, key=None) -> loss` on the devices of `axes`: `gpt_parallel.loss`, or with `axes.pipe`
    `gpt_pipeline.loss` running the schedule `table`."""
    if axes.pipe is None:
        return functools.partial(gpt_parallel.loss, config=model_config, axes=axes)
    if table is None:
        raise ValueError(f"a pipelined loss (axes.pipe={axes.pipe!r}) needs the schedule's table")
    return functools.partial(gpt_pipeline.loss, config=model_config, table=table, axes=axes)


def make_loss_fn(model_config: gpt.GPTConfig, policy: Policy, axes: MeshAxes = MeshAxes(), table: Any = None):
    """`(params, batch, key) -> (loss, metrics)` for `optim.train_step`, run in the policy's compute dtype, on
    the devices of `axes` (the loss is then the mean over all data shards; the step sums the gradients). The
    metrics are a mixture of experts' (`gpt_parallel.loss_and_metrics`: moe_aux, moe_dropped), else none."""
    if axes.pipe is None:
        loss_and_metrics = functools.partial(gpt_parallel.loss_and_metrics, config=model_config, axes=axes)
        return with_policy(lambda params, batch, key: loss_and_metrics(params, batch, key=key), policy)
    loss = with_policy(model_loss(model_config, axes, table), policy)

    def loss_fn(params, batch, key):
        return loss(params, batch, key=key), {}

    return loss_fn


def schedule(settings: GPTSettings) -> pipeline_schedules.Table | None:
    """The pipeline's table for `--pp`, `--micro_batches` and `--pipeline_schedule` (None without --pp)."""
    return (
        pipeline_schedules.SCHEDULES[settings.pipeline_schedule](settings.pp, settings.micro_batches)
        if settings.pp > 1
        else None
    )


def model_specs(model_config: gpt.GPTConfig, devices: Devices) -> Any:
    """A PartitionSpec per param on the devices' mesh (None on one device): gpt_parallel's layout, with the
    blocks' layer axis split into stages under pipeline parallelism."""
    if not devices.sharded:
        return None
    specs = gpt_parallel.param_specs(model_config, devices.axes, devices.mesh.shape)
    return specs if devices.axes.pipe is None else pipeline.stage_specs(specs, devices.axes.pipe)


def compile_step(
    settings: GPTSettings, model_config: gpt.GPTConfig, devices: Devices, state_specs: Any, param_specs: Any
):
    """(the training step `(state, batch) -> (state, metrics)`, the loss `(params, x, y) -> loss`) on the
    devices, in the policy's compute dtype; compiled on first use. The evaluation loss is the cross-entropy
    alone (a mixture of experts' load-balancing term is in the training loss, not in train_loss/val_loss)."""
    policy, table = Policy(jnp.float32, settings.dtype, jnp.float32), schedule(settings)
    optimizer = make_optimizer(settings, devices.axes.data)  # the data axis: Shampoo shares its roots over it
    step_kwargs = dict(
        loss_fn=make_loss_fn(model_config, policy, devices.axes, table),
        optimizer=optimizer,
        max_grad_norm=settings.grad_clip or None,
        micro_batches=settings.gradient_accumulation_steps,
    )
    if not settings.compile and devices.sharded:
        raise SystemExit(
            "error: --compile=False (op by op, for debugging) runs on one device; drop --dp/--tp/--fsdp/--cp/--pp"
        )
    if settings.compile:
        step_fn = devices.train_step(state_specs, **step_kwargs)
    else:
        step_fn = functools.partial(optim.train_step, **step_kwargs)

    def loss(params, batch, axes):  # the cross-entropy alone: a mixture of experts' aux term weighted 0
        moe = gpt_moe.n_experts(model_config)
        evaluated = dataclasses.replace(model_config, moe_aux_weight=0.0) if moe else model_config
        return with_policy(model_loss(evaluated, axes, table), policy)(params, batch)

    return step_fn, devices.evaluate(loss, param_specs)
