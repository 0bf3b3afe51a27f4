"""The models a program reads rather than trains: a train.gpt out_dir's checkpoint (`load_model`, for
train.sample and train.eval), and which of our importers reads a Hugging Face directory (`FAMILIES`, for
train.finetune and train.eval)."""

from pathlib import Path

import jax
import jax.numpy as jnp

from models import gpt, gpt_moe
from purejax import checkpoint

FAMILIES = {"gpt2": "gpt_hf", "llama": "llama_hf"}  # a config.json's model_type -> the models module that reads it


def load_model(out_dir: str | Path, step: int | None = None) -> tuple[dict, gpt.GPTConfig, int]:
    """(params, config, step) from out_dir's newest readable (or `step`'s) checkpoint, reading the params only;
    a one-line SystemExit for a missing step, a damaged file, or a checkpoint that is not a GPT's."""
    manager = checkpoint.CheckpointManager(out_dir, keep_last=None)
    steps = manager.steps()
    if not steps:
        raise SystemExit(
            f"error: no checkpoint in {str(out_dir)!r}; train one with `python -m train.gpt --out_dir={out_dir}`"
        )
    if step is not None and step not in steps:
        raise SystemExit(f"error: no checkpoint for step {step} in {str(out_dir)!r}; its steps are {steps}")
    try:
        params, info = manager.restore(step=step, subtree="params")
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyError:
        raise SystemExit(
            f"error: {manager.path(steps[-1] if step is None else step)} holds no 'params': not a train.gpt checkpoint"
        ) from None
    model = info.config.get("model") if isinstance(info.config, dict) else None
    try:
        config = gpt_moe.gpt_config(model)
    except (TypeError, ValueError) as e:
        raise SystemExit(
            f"error: {info.path} has no GPT config (its config['model'] is {model!r}: {e}); "
            "is it a train.gpt checkpoint?"
        ) from None
    return jax.tree.map(jnp.asarray, params), config, info.step
