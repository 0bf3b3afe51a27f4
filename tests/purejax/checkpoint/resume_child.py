"""A small training run for the resume-equivalence test, importable by the test and runnable as a process.

    python resume_child.py DIR OPTIMIZER STEPS

restores the newest checkpoint in DIR (a fresh process: nothing carried over but the file), trains until
STEPS and saves the final state to DIR/final.msgpack. OPTIMIZER is "purejax" (purejax.optim.adamw with a
warmup-cosine schedule) or "optax" (optax.adamw): both keep counts, moments and NamedTuples in their state.
The step's randomness (batch and dropout) comes from the key in the state, so a resumed run can match.
"""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from purejax import checkpoint, optim


def optimizer(name: str):
    if name == "purejax":
        return optim.adamw(optim.schedules.warmup_cosine(1e-2, warmup_steps=2, decay_steps=10), weight_decay=0.1)
    return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1)


@functools.partial(jax.jit, static_argnums=0)  # one compilation, not one per eager operation
def init_state(name: str, key):
    k1, k2, key = jax.random.split(key, 3)
    params = {
        "hidden": {"w": jax.random.normal(k1, (8, 16)) / 3, "b": jnp.zeros(16)},
        "out": {"w": jax.random.normal(k2, (16, 1)) / 4},
    }
    return {"params": params, "opt_state": optimizer(name).init(params), "key": key, "step": jnp.zeros((), jnp.int32)}


@functools.cache
def make_train_step(name: str):
    tx = optimizer(name)

    @jax.jit
    def train_step(state):
        key, batch_key, dropout_key = jax.random.split(state["key"], 3)
        x = jax.random.normal(batch_key, (32, 8))
        y = jnp.sin(x.sum(axis=1, keepdims=True))

        def loss(params):
            h = jax.nn.gelu(x @ params["hidden"]["w"] + params["hidden"]["b"])
            h = h * jax.random.bernoulli(dropout_key, 0.9, h.shape) / 0.9
            return jnp.mean((h @ params["out"]["w"] - y) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = (optim.apply_updates if name == "purejax" else optax.apply_updates)(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "key": key, "step": state["step"] + 1}

    return train_step


def train(name: str, state, until: int):
    train_step = make_train_step(name)
    while int(state["step"]) < until:
        state = train_step(state)
    return state


def main(directory: str, name: str, steps: str) -> None:
    template = jax.eval_shape(init_state, name, jax.random.key(0))
    restored = checkpoint.CheckpointManager(directory).restore(like=template)
    state = train(name, restored.tree, int(steps))
    checkpoint.save(Path(directory) / "final.msgpack", state, step=int(state["step"]))


if __name__ == "__main__":
    main(*sys.argv[1:])
