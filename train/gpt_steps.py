"""What `python -m train.gpt` runs each step, on the devices it was given: the loss (gpt_parallel's,
or with `--pp` the pipelined one of models/gpt_pipeline.py), the params' layout, the training step and
the evaluation loss.

    param_specs = model_specs(model, devices)          # None on one device
    step_fn, eval_loss = compile_step(cfg, model, devices, state_specs, param_specs)

With `--pp` the training step is the ordinary `sharded_train_step`: the pipelined loss is a `jax.custom_vjp`
whose gradient is the one the schedule computed, so loss scaling, gradient accumulation, clipping, the
optimizer and the data-parallel gradient sum run unchanged. Evaluation runs the pipeline's forwards alone on
the params where they lie (each stage its own layers), with no gather.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from models import gpt, gpt_parallel, gpt_pipeline
from purejax import optim
from purejax.parallel import MeshAxes, pipeline, schedules
from purejax.precision import Policy, with_policy
from train.gpt_config import TrainConfig, make_optimizer
from train.parallel import Devices


def model_loss(model: gpt.GPTConfig, axes: MeshAxes, table: schedules.Table | None = None) -> Callable:
    """`(params, batch, key=None) -> loss` on the devices of `axes`: `gpt_parallel.loss`, or with `axes.pipe`
    `gpt_pipeline.loss` running the schedule `table`."""
    if axes.pipe is None:
        return functools.partial(gpt_parallel.loss, config=model, axes=axes)
    if table is None:
        raise ValueError(f"a pipelined loss (axes.pipe={axes.pipe!r}) needs the schedule's table")
    return functools.partial(gpt_pipeline.loss, config=model, table=table, axes=axes)


def make_loss_fn(model: gpt.GPTConfig, policy: Policy, axes: MeshAxes = MeshAxes(), table: Any = None):
    """`(params, batch, key) -> (loss, metrics)` for `optim.train_step`, run in the policy's compute dtype, on
    the devices of `axes` (the loss is then the mean over all data shards; the step sums the gradients). The
    metrics are a mixture of experts' (`gpt_parallel.loss_and_metrics`: moe_aux, moe_dropped), else none."""
    if axes.pipe is None:
        loss_and_metrics = functools.partial(gpt_parallel.loss_and_metrics, config=model, axes=axes)
        return with_policy(lambda params, batch, key: loss_and_metrics(params, batch, key=key), policy)
    loss = with_policy(model_loss(model, axes, table), policy)

    def loss_fn(params, batch, key):
        return loss(params, batch, key=key), {}

    return loss_fn


def schedule(cfg: TrainConfig) -> schedules.Table | None:
    """The pipeline's table for `--pp`, `--micro_batches` and `--pipeline_schedule` (None without --pp)."""
    return schedules.SCHEDULES[cfg.pipeline_schedule](cfg.pp, cfg.micro_batches) if cfg.pp > 1 else None


def model_specs(model: gpt.GPTConfig, devices: Devices) -> Any:
    """A PartitionSpec per param on the devices' mesh (None on one device): gpt_parallel's layout, with the
    blocks' layer axis split into stages under pipeline parallelism."""
    if not devices.sharded:
        return None
    specs = gpt_parallel.param_specs(model, devices.axes, devices.mesh.shape)
    return specs if devices.axes.pipe is None else pipeline.stage_specs(specs, devices.axes.pipe)


def compile_step(cfg: TrainConfig, model: gpt.GPTConfig, devices: Devices, state_specs: Any, param_specs: Any):
    """(the training step `(state, batch) -> (state, metrics)`, the loss `(params, x, y) -> loss`) on the
    devices, in the policy's compute dtype; compiled on first use. The evaluation loss is the cross-entropy
    alone (a mixture of experts' load-balancing term is in the training loss, not in train_loss/val_loss)."""
    policy, table = Policy(jnp.float32, cfg.dtype, jnp.float32), schedule(cfg)
    optimizer = make_optimizer(cfg, devices.axes.data)  # the data axis: Shampoo shares its roots over it
    step_kwargs = dict(
        loss_fn=make_loss_fn(model, policy, devices.axes, table),
        optimizer=optimizer,
        max_grad_norm=cfg.grad_clip or None,
        micro_batches=cfg.gradient_accumulation_steps,
    )
    if not cfg.compile and devices.sharded:
        raise SystemExit(
            "error: --compile=False (op by op, for debugging) runs on one device; drop --dp/--tp/--fsdp/--cp/--pp"
        )
    if cfg.compile:
        step_fn = devices.train_step(state_specs, **step_kwargs)
    else:
        step_fn = functools.partial(optim.train_step, **step_kwargs)

    def loss(params, batch, axes):  # the cross-entropy alone: a mixture of experts' aux term weighted 0
        evaluated = dataclasses.replace(model, moe_aux_weight=0.0)
        return with_policy(model_loss(evaluated, axes, table), policy)(params, batch)

    return step_fn, devices.evaluate(loss, param_specs)
