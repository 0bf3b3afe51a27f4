"""The `purejax` contenders of bench/gpt_train.py (`purejax`, `purejax-scan`, `purejax-loop`): the step exactly as
train/gpt.py builds it, which bench/gpt_anatomy.py also times in its variants.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from bench.gpt_train_recipe import GRAD_CLIP, TRAIN
from purejax import optim
from purejax.precision import Policy
from train import gpt as train_gpt


def make_purejax(weights, config, x, y, layers=None, *, optimizer=None, donate=True, dtype="float32"):
    """The step of train/gpt.py: optim.train_step with make_optimizer and make_loss_fn, jitted, state donated.
    `layers` None keeps `config.layers` (the `purejax` contender: GPTConfig's default); `optimizer` and `donate`
    let bench/gpt_anatomy.py time variants of the same step."""
    model = config if layers is None else dataclasses.replace(config, layers=layers)
    optimizer = optimizer or train_gpt.make_optimizer(TRAIN)
    loss_fn = train_gpt.make_loss_fn(model, Policy(jnp.float32, dtype, jnp.float32))
    step_fn = partial(optim.train_step, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=GRAD_CLIP)
    step_fn = jax.jit(step_fn, donate_argnums=0 if donate else ())
    state = optim.init_train_state(jax.tree.map(jnp.array, weights), optimizer, jax.random.key(0))
    batch = (jnp.asarray(x), jnp.asarray(y))

    def step():
        nonlocal state
        state, metrics = step_fn(state, batch)
        return metrics["loss"]

    def scratch_bytes() -> int:
        """XLA's temporary buffers for one step (compile only): what rematerialisation trades time for."""
        return step_fn.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    step.scratch_bytes = scratch_bytes
    return step
