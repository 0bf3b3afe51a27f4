"""The perplexity of a text under a trained model: the mean next-token loss (nats) and its exponential.

    python -m train.eval --model=out-gpt --text=notes.txt                  # a train.gpt out_dir, its tokenizer
    python -m train.eval --model=out-gpt/ckpt_00000500.msgpack --text=notes.txt --stride=32
    python -m train.eval --model=path/to/hf-llama --ids=tokens.npy        # a Hugging Face GPT-2 or Llama directory
    python -m train.eval --help                                           # every setting, its default and range

The text is tokenized with the model's own tokenizer (the `tokenizer.json` beside the checkpoint, or in the
Hugging Face directory, read with `train.data.load_tokenizer`); `--ids` scores token ids made elsewhere
instead: a 1-D `.npy`, or a prepared dataset's `train.bin`/`val.bin`. The model sees `--context` tokens at a
time (its own context length by default), in windows that move `--stride` tokens (train/perplexity.py): every
token but the first is scored once, and a smaller stride gives each more context at more cost. With several
local devices the windows of a batch are split over them.
"""

from train.kit import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import functools
import importlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models import gpt, gpt_moe
from purejax import checkpoint
from train import perplexity
from train.data import load_tokenizer
from train.data.dataset import token_file_dtype
from train.kit import settings as settings_lib
from train.kit.settings import setting
from train.kit.trained import FAMILIES, load_model


@dataclass(frozen=True)
class EvalConfig:
    """Every setting of `python -m train.eval`."""

    model: str = setting(
        "out-gpt", "a train.gpt out_dir, one of its checkpoint files, or a Hugging Face GPT-2 or Llama directory"
    )
    text: str = setting("", "the UTF-8 text file to score, tokenized with the model's own tokenizer")
    ids: str = setting("", "instead of --text: token ids to score, a 1-D .npy or a prepared dataset's .bin file")
    context: int | None = setting(None, "tokens the model sees at once (none: its context length)", at_least=1)
    stride: int | None = setting(
        None, "tokens each window moves on (none: the context, disjoint windows); smaller: more context", at_least=1
    )
    batch_size: int = setting(8, "windows scored at once", at_least=1)
    step: int | None = setting(None, "with an out_dir: the checkpoint's step (none: the newest readable)", at_least=0)

    def __post_init__(self):
        settings_lib.check_ranges(self)


class Model(NamedTuple):
    """What scoring needs of a model: its params, `logits(params, idx)`, its context length and vocabulary,
    and where its tokenizer is."""

    params: Any
    logits: perplexity.LogitsFn
    context: int
    vocab_size: int
    tokenizer_file: Path


def open_model(path: str, step: int | None) -> Model:
    """The model at `path`: a Hugging Face directory (config.json), a train.gpt out_dir, or one checkpoint file."""
    where = Path(path)
    if not where.exists():
        raise SystemExit(f"error: --model={path!r}: no such file or directory")
    hugging_face = (where / "config.json").is_file()
    if step is not None and (hugging_face or not where.is_dir()):
        raise SystemExit(f"error: --step={step} applies only to a train.gpt out_dir, and {path!r} is not one")
    if hugging_face:
        return open_hugging_face(where)
    if where.is_dir():
        params, config, _ = load_model(where, step)
    else:
        try:
            params, info = checkpoint.restore(where, subtree="params")
            config = gpt_moe.gpt_config(info.config["model"])
        except (checkpoint.CheckpointError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"error: {path} is not a train.gpt checkpoint with a GPT config: {e}") from None
    folder = where if where.is_dir() else where.parent
    logits = functools.partial(gpt.apply, config=config)
    return Model(
        jax.tree.map(jnp.asarray, params), logits, config.block_size, config.vocab_size, folder / "tokenizer.json"
    )


def open_hugging_face(directory: Path) -> Model:
    """A GPT-2 or Llama model from a Hugging Face directory, by its config.json's `model_type`."""
    kind = json.loads((directory / "config.json").read_text()).get("model_type")
    if kind not in FAMILIES:
        raise SystemExit(
            f"error: {directory / 'config.json'} has model_type {kind!r}; train.eval reads {sorted(FAMILIES)}"
        )
    importer = importlib.import_module(f"models.{FAMILIES[kind]}")
    params, config = importer.load(directory)
    if kind == "gpt2":
        context, module = config.block_size, gpt
    else:
        context, module = config.max_seq_len, importlib.import_module("models.llama")
    logits = functools.partial(module.apply, config=config)
    return Model(params, logits, context, config.vocab_size, directory / "tokenizer.json")


def read_text_ids(text_file: str, model: Model) -> np.ndarray:
    """The ids of the UTF-8 text in `text_file`, by the model's own tokenizer."""
    if not model.tokenizer_file.is_file():
        raise SystemExit(
            f"error: no tokenizer at {model.tokenizer_file}; give the text as token ids instead, --ids=<.npy>"
        )
    try:
        tokenizer = load_tokenizer(model.tokenizer_file)
    except ValueError as e:
        raise SystemExit(
            f"error: cannot read the tokenizer {model.tokenizer_file} ({e}); tokenize the text elsewhere and "
            "give the ids, --ids=<.npy>"
        ) from None
    if tokenizer.vocab_size > model.vocab_size:
        raise SystemExit(
            f"error: the tokenizer {model.tokenizer_file} has {tokenizer.vocab_size} tokens, more than the "
            f"{model.vocab_size} rows of the model's embedding: it is not this model's tokenizer"
        )
    path = Path(text_file)
    if not path.is_file():
        raise SystemExit(f"error: --text={text_file!r}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(
            f"error: {text_file} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason})"
        ) from None
    try:
        return np.asarray(tokenizer.encode(text), np.int64)
    except ValueError as e:
        raise SystemExit(f"error: {text_file} cannot be encoded with {model.tokenizer_file}: {e}") from None


def read_ids(ids_file: str) -> np.ndarray:
    """Token ids from a 1-D integer `.npy`, or a prepared dataset's `.bin` (train.data: little-endian uint16, or
    the dtype its meta.json beside it names)."""
    path = Path(ids_file)
    if not path.is_file():
        raise SystemExit(f"error: --ids={ids_file!r}: no such file")
    if path.suffix == ".bin":
        meta = json.loads(path.with_name("meta.json").read_text()) if path.with_name("meta.json").is_file() else {}
        try:
            return np.fromfile(path, dtype=token_file_dtype(meta, path.parent)).astype(np.int64)
        except ValueError as e:
            raise SystemExit(f"error: --ids={ids_file!r}: {e}") from None
    if path.suffix != ".npy":
        raise SystemExit(f"error: --ids={ids_file!r}: expected a .npy file or a prepared dataset's .bin file")
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise SystemExit(f"error: {ids_file} is not a readable .npy file: {e}") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise SystemExit(f"error: {ids_file} holds {ids.dtype} of shape {ids.shape}; expected a 1-D integer array")
    return ids.astype(np.int64)


def check_ids(ids: np.ndarray, vocab_size: int, source: str) -> None:
    """At least 2 ids, all in the model's vocabulary [0, vocab_size); else an error naming the first bad one."""
    if len(ids) < 2:
        raise SystemExit(
            f"error: {source} is {len(ids)} token(s) long; a perplexity needs at least 2 (one to predict from)"
        )
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise SystemExit(
            f"error: {source}: token id {ids[bad[0]]} at position {bad[0]} is outside the model's vocabulary "
            f"[0, {vocab_size}) ({bad.size} such ids)"
        )


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    settings = settings_lib.command_line(EvalConfig, argv, prog="train.eval", doc=__doc__)
    if bool(settings.text) == bool(settings.ids):
        raise SystemExit("error: give the tokens to score as one of --text=<file> or --ids=<file>")
    model = open_model(settings.model, settings.step)
    ids = read_text_ids(settings.text, model) if settings.text else read_ids(settings.ids)
    check_ids(ids, model.vocab_size, settings.text or settings.ids)
    context = settings.context or model.context
    if context > model.context:
        raise SystemExit(f"error: context={context} exceeds the model's context length {model.context}")
    stride = settings.stride or context
    try:
        windows = perplexity.plan_windows(len(ids), context, stride)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    start = time.perf_counter()
    total, scored = perplexity.score(model.logits, model.params, ids, windows, settings.batch_size)
    loss = total / scored
    result = {"loss": loss, "perplexity": math.exp(loss), "tokens": scored, "windows": len(windows)}
    print(
        f"{scored:,} tokens scored in {len(windows)} windows of {context} (stride {stride}) in "
        f"{time.perf_counter() - start:.1f} s: loss {loss:.4f} nats/token, perplexity {result['perplexity']:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
