"""The models `python -m train.finetune` starts from, read from a Hugging Face directory by its
config.json's `model_type`: GPT-2 (`gpt2`, models/gpt_hf.py) and Llama (`llama`, llama_hf.py).

Each family is the same four functions over its own model file, so the program never branches on the model:

    base = load(directory, settings)              # Base(params, model_config, family): frozen, cropped, base_dtype
    params, model_config = read(directory)        # as the file has it: float32, the whole context
    loss_fn = model_loss(base.model_config)       # (params, batch, *, key=None) -> scalar: the model's own loss
    ids = generate(params, base.model_config, prompt, key=key, max_new_tokens=..., temperature=..., top_k=...)
    save(params, base.model_config, directory)    # the Hugging Face layout again (for --merge_into)
    check_settings(settings, base)                # what needs the base or the disk, before anything compiles

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
from train.kit.text import load_gpt2
from train.kit.trained import FAMILIES


class Base(NamedTuple):
    """The frozen model: its params, its config (gpt.GPTConfig or llama.LlamaConfig) and its family."""

    params: dict
    model_config: Any
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


def load(directory: str | Path, settings: Any) -> Base:
    """The base from `directory`, with the run's dropout and layer form, its context cropped to block_size
    (GPT-2's learned positions; Llama's rotary has no table and keeps max_seq_len), in `settings.base_dtype`."""
    kind = family(directory)
    if kind == "gpt2":
        params, model_config = load_gpt2(
            str(directory), settings.block_size, dropout=settings.dropout, layers=settings.layers
        )
    else:
        if settings.dropout:
            raise SystemExit(
                f"error: --dropout={settings.dropout}: Llama trains without dropout (it has none to turn on)"
            )
        params, model_config = read(directory)
        model_config = dataclasses.replace(model_config, layers=settings.layers)
        if settings.block_size > model_config.max_seq_len:
            raise SystemExit(
                f"error: block_size={settings.block_size} exceeds the model's max_seq_len={model_config.max_seq_len}"
            )
    return Base(tree_lib.cast_floating(params, jnp.dtype(settings.base_dtype)), model_config, kind)


def read(directory: str | Path) -> tuple[dict, Any]:
    """(params, model config) as the directory has them: float32, the whole context (what --merge_into merges
    into)."""
    return importlib.import_module(f"models.{FAMILIES[family(directory)]}").load(directory)


def model_loss(model_config: Any):
    """`(params, batch, *, key=None) -> loss`: the model's mean next-token cross-entropy (dropout with a key,
    for the GPT; Llama has none and ignores it)."""
    if isinstance(model_config, gpt.GPTConfig):
        return functools.partial(gpt.loss, config=model_config)
    llama = importlib.import_module("models.llama")

    def loss(params: dict, batch: Any, *, key: Any = None) -> jax.Array:
        del key  # no dropout in Llama
        return llama.loss(params, batch, model_config)

    return loss


def generate(params: dict, model_config: Any, prompt: jax.Array, *, vocab_size: int, **sampling: Any) -> jax.Array:
    """`sampling` (key, max_new_tokens, temperature, top_k) passed to the family's `generate`, never sampling an
    id of `vocab_size` or more (a 50257-row GPT-2 under a 256-id byte tokenizer): those rows are cropped."""
    if isinstance(model_config, gpt.GPTConfig):
        from models import gpt_decode, gpt_surgery

        if model_config.vocab_size > vocab_size:
            params, model_config = gpt_surgery.crop_vocab(params, model_config, vocab_size)
        return gpt_decode.generate(params, prompt, model_config, **sampling)
    llama_decode = importlib.import_module("models.llama_decode")
    if model_config.vocab_size > vocab_size:
        params, model_config = _crop_llama_vocab(params, model_config, vocab_size)
    max_len = min(prompt.shape[1] + sampling["max_new_tokens"], model_config.max_seq_len)
    return llama_decode.generate(params, prompt, model_config, max_len=max_len, **sampling)


def _crop_llama_vocab(params: dict, model_config: Any, vocab_size: int) -> tuple[dict, Any]:
    """The first `vocab_size` rows of the embedding and columns of the head (Llama's own, or the tied one)."""
    params = {**params, "embed": {"w": params["embed"]["w"][:vocab_size]}}
    if "head" in params:
        params["head"] = {"w": params["head"]["w"][:, :vocab_size]}
    return params, dataclasses.replace(model_config, vocab_size=vocab_size)


def save(params: dict, model_config: Any, directory: str | Path) -> None:
    """The params in their family's Hugging Face layout (`gpt_hf.save` or `llama_hf.save`)."""
    module = FAMILIES["gpt2" if isinstance(model_config, gpt.GPTConfig) else "llama"]
    importlib.import_module(f"models.{module}").save(params, model_config, directory)


def check_settings(settings: Any, base: Base) -> None:
    """The settings that need the base or the disk, checked before anything compiles (a one-line SystemExit
    naming the setting): every target selects matrices, `lora_rank` is at most the width of each (`check_rank`),
    and `merge_into` can take the merged model (`check_merge_into`)."""
    lora_config = settings.lora_config()
    try:
        paths = lora.select(base.params, lora_config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    check_rank(base.params, lora_config, paths)
    check_merge_into(settings.merge_into)


def check_rank(params: dict, lora_config: lora.LoraConfig, paths: list[str]) -> None:
    """A (d_in, d_out) matrix's change A @ B has rank at most min(d_in, d_out): a larger rank adds parameters
    (and a larger adapters file) but no capacity, so `lora_config.rank` must not exceed the narrowest adapted side."""
    flat = tree_lib.flatten(params)
    path = min(paths, key=lambda p: min(flat[p].shape[-2:]))
    d_in, d_out = flat[path].shape[-2:]
    if lora_config.rank > min(d_in, d_out):
        raise SystemExit(
            f"error: --lora_rank={lora_config.rank} exceeds the width of {path} ({d_in} x {d_out}): an "
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
