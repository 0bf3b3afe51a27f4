"""The models `python -m train.finetune` starts from, read from a Hugging Face directory by its
config.json's `model_type`: GPT-2 (`gpt2`, models/gpt_hf.py) and Llama (`llama`, llama_hf.py).

Each family is the same four functions over its own model file, so the program never branches on the model:

    base = load(directory, cfg)            # Base(params, config, family): frozen, cropped, in base_dtype
    params, config = read(directory)      # as the file has it: float32, the whole context
    loss_fn = model_loss(base.config)     # (params, batch, *, key=None) -> scalar: the model's own loss
    ids = generate(params, base.config, prompt, key=key, max_new_tokens=..., temperature=..., top_k=...)
    save(params, base.config, directory)  # the Hugging Face layout again (for --merge_into)
    check_settings(cfg, base)             # what needs the base or the disk, before anything compiles

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

from models import gpt
from purejax import lora
from purejax import tree as tree_lib
from train.data.prepare import check_writable
from train.gpt_config import load_gpt2

FAMILIES = {"gpt2": "gpt_hf", "llama": "llama_hf"}  # config.json's model_type -> the models module


class Base(NamedTuple):
    """The frozen model: its params, its config (gpt.GPTConfig or llama.LlamaConfig) and its family."""

    params: dict
    config: Any
    family: str


def family(directory: str | Path) -> str:
    """The model_type of the Hugging Face directory, checked to be one this program fine-tunes."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise SystemExit(
            f"error: --init_from={str(directory)!r} is not a Hugging Face model directory (no "
            "config.json there); give a GPT-2 or Llama directory, or 'resume'"
        )
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
    return importlib.import_module(f"models.{FAMILIES[family(directory)]}").load(directory)


def model_loss(config: Any):
    """`(params, batch, *, key=None) -> loss`: the model's mean next-token cross-entropy (dropout with a key,
    for the GPT; Llama has none and ignores it)."""
    if isinstance(config, gpt.GPTConfig):
        return functools.partial(gpt.loss, config=config)
    llama = importlib.import_module("models.llama")

    def loss(params: dict, batch: Any, *, key: Any = None) -> jax.Array:
        del key  # no dropout in Llama
        return llama.loss(params, batch, config)

    return loss


def generate(params: dict, config: Any, prompt: jax.Array, *, vocab_size: int, **settings: Any) -> jax.Array:
    """`settings` (key, max_new_tokens, temperature, top_k) passed to the family's `generate`, never sampling an
    id of `vocab_size` or more (a 50257-row GPT-2 under a 256-id byte tokenizer): those rows are cropped."""
    if isinstance(config, gpt.GPTConfig):
        from models import gpt_decode, gpt_surgery

        if config.vocab_size > vocab_size:
            params, config = gpt_surgery.crop_vocab(params, config, vocab_size)
        return gpt_decode.generate(params, prompt, config, **settings)
    llama_decode = importlib.import_module("models.llama_decode")
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
    importlib.import_module(f"models.{module}").save(params, config, directory)


def check_settings(cfg: Any, base: Base) -> None:
    """The settings that need the base or the disk, checked before anything compiles (a one-line SystemExit
    naming the setting): every target selects matrices, `lora_rank` is at most the width of each (`check_rank`),
    and `merge_into` can take the merged model (`check_merge_into`)."""
    config = cfg.lora_config()
    try:
        paths = lora.select(base.params, config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    check_rank(base.params, config, paths)
    check_merge_into(cfg.merge_into)


def check_rank(params: dict, config: lora.LoraConfig, paths: list[str]) -> None:
    """A (d_in, d_out) matrix's change A @ B has rank at most min(d_in, d_out): a larger rank adds parameters
    (and a larger adapters file) but no capacity, so `config.rank` must not exceed the narrowest adapted side."""
    flat = tree_lib.flatten(params)
    path = min(paths, key=lambda p: min(flat[p].shape[-2:]))
    d_in, d_out = flat[path].shape[-2:]
    if config.rank > min(d_in, d_out):
        raise SystemExit(
            f"error: --lora_rank={config.rank} exceeds the width of {path} ({d_in} x {d_out}): an "
            f"adapter's change has rank at most {min(d_in, d_out)}; give --lora_rank at most that"
        )


def check_merge_into(directory: str) -> None:
    """`--merge_into` (if given) a new or empty directory that can be written (created now): the merged model
    is written at the end of the run, and a file there, a directory holding something else (another model, the
    base itself) or one that cannot be written would fail or overwrite it only after training."""
    if not directory:
        return
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise SystemExit(
            f"error: --merge_into={directory!r} is a file; the merged model is a directory: give a new or empty one"
        )
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held:
        raise SystemExit(
            f"error: --merge_into={directory!r} already holds {', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}; the merged model goes to a new or empty directory"
        )
    try:
        check_writable(path, what="the merged model")
    except OSError as e:  # check_writable words its message for --out_dir; the cause is the OSError it caught
        reason = getattr(e.__context__, "strerror", None) or e
        raise SystemExit(
            f"error: --merge_into={directory!r} cannot be written ({reason}); give another directory"
        ) from None
