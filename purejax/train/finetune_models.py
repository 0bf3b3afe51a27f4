"""The models `python -m purejax.train.finetune` starts from, read from a Hugging Face directory by its
config.json's `model_type`: GPT-2 (`gpt2`, purejax/models/gpt_hf.py) and Llama (`llama`, llama_hf.py).

Each family is the same four functions over its own model file, so the program never branches on the model:

    base = load(directory, cfg)            # Base(params, config, family): frozen, cropped, in base_dtype
    params, config = read(directory)      # as the file has it: float32, the whole context
    loss_fn = model_loss(base.config)     # (params, batch, *, key=None) -> scalar: the model's own loss
    ids = generate(params, base.config, prompt, key=key, max_new_tokens=..., temperature=..., top_k=...)
    save(params, base.config, directory)  # the Hugging Face layout again (for --merge_into)

A model module is imported only when its family is used.
"""

import dataclasses
import functools
import importlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from purejax import tree as tree_lib
from purejax.models import gpt
from purejax.train.gpt_config import load_gpt2

FAMILIES = {"gpt2": "gpt_hf", "llama": "llama_hf"}  # config.json's model_type -> the purejax.models module


class Base(NamedTuple):
    """The frozen model: its params, its config (gpt.GPTConfig or llama.LlamaConfig) and its family."""

    params: dict
    config: Any
    family: str


def family(directory: str | Path) -> str:
    """The model_type of the Hugging Face directory, checked to be one this program fine-tunes."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"error: --init_from={str(directory)!r} is not a Hugging Face model directory (no "
                         "config.json there); give a GPT-2 or Llama directory, or 'resume'")  # fmt: skip
    kind = json.loads(config_file.read_text()).get("model_type")
    if kind not in FAMILIES:
        raise SystemExit(f"error: {config_file} has model_type {kind!r}; train.finetune reads {sorted(FAMILIES)}")
    return kind


def load(directory: str | Path, cfg: Any) -> Base:
    """The base from `directory`, with the run's dropout and layer form, its context cropped to block_size
    (GPT-2's learned positions; Llama's rotary has no table and keeps max_seq_len), in `cfg.base_dtype`."""
    kind = family(directory)
    if kind == "gpt2":
        params, config = load_gpt2(cfg.train_config(init_from=str(directory)))
    else:
        if cfg.dropout:
            raise SystemExit(f"error: --dropout={cfg.dropout}: Llama trains without dropout (it has none to turn on)")
        params, config = read(directory)
        config = dataclasses.replace(config, layers=cfg.layers)
        if cfg.block_size > config.max_seq_len:
            raise SystemExit(f"error: block_size={cfg.block_size} exceeds the model's max_seq_len={config.max_seq_len}")
    return Base(tree_lib.cast_floating(params, jnp.dtype(cfg.base_dtype)), config, kind)


def read(directory: str | Path) -> tuple[dict, Any]:
    """(params, config) as the directory has them: float32, the whole context (what --merge_into merges into)."""
    return importlib.import_module(f"purejax.models.{FAMILIES[family(directory)]}").load(directory)


def model_loss(config: Any):
    """`(params, batch, *, key=None) -> loss`: the model's mean next-token cross-entropy (dropout with a key,
    for the GPT; Llama has none and ignores it)."""
    if isinstance(config, gpt.GPTConfig):
        return functools.partial(gpt.loss, config=config)
    llama = importlib.import_module("purejax.models.llama")

    def loss(params: dict, batch: Any, *, key: Any = None) -> jax.Array:
        del key  # no dropout in Llama
        return llama.loss(params, batch, config)

    return loss


def generate(params: dict, config: Any, prompt: jax.Array, *, vocab_size: int, **settings: Any) -> jax.Array:
    """`settings` (key, max_new_tokens, temperature, top_k) passed to the family's `generate`, never sampling an
    id of `vocab_size` or more (a 50257-row GPT-2 under a 256-id byte tokenizer): those rows are cropped."""
    if isinstance(config, gpt.GPTConfig):
        from purejax.models import gpt_decode, gpt_surgery

        if config.vocab_size > vocab_size:
            params, config = gpt_surgery.crop_vocab(params, config, vocab_size)
        return gpt_decode.generate(params, prompt, config, **settings)
    llama_decode = importlib.import_module("purejax.models.llama_decode")
    if config.vocab_size > vocab_size:
        params, config = _crop_llama_vocab(params, config, vocab_size)
    max_len = min(prompt.shape[1] + settings["max_new_tokens"], config.max_seq_len)
    return llama_decode.generate(params, prompt, config, max_len=max_len, **settings)


def _crop_llama_vocab(params: dict, config: Any, vocab_size: int) -> tuple[dict, Any]:
    """The first `vocab_size` rows of the embedding and columns of the head (Llama's own, or the tied one)."""
    params = {**params, "embed": {"w": params["embed"]["w"][:vocab_size]}}
    if "head" in params:
        params["head"] = {"w": params["head"]["w"][:, :vocab_size]}
    return params, dataclasses.replace(config, vocab_size=vocab_size)


def save(params: dict, config: Any, directory: str | Path) -> None:
    """The params in their family's Hugging Face layout (`gpt_hf.save` or `llama_hf.save`)."""
    module = FAMILIES["gpt2" if isinstance(config, gpt.GPTConfig) else "llama"]
    importlib.import_module(f"purejax.models.{module}").save(params, config, directory)
