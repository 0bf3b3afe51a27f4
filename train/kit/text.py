"""What the programs that train a language model on text share (`train.gpt`, `train.finetune`): the dataset,
opened and checked against the checkpoint's; the loss estimate over both splits; GPT-2's weights and tokenizer
read from a Hugging Face directory for `--init_from`.

    dataset, fingerprint = open_data(settings, devices, saved, tokenizer=model_tokenizer(settings.init_from))
    losses = estimate_loss(eval_loss, state.params, dataset, settings, iteration, devices)
    params, model_config = load_gpt2(settings.init_from, settings.block_size, dropout=..., layers=..., remat=...)

`settings` are a program's, with the fields `dataset`, `tokenizer`, `batch_size`, `block_size`, `eval_iters`
and `seed`.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax

from models import gpt, gpt_surgery
from purejax.parallel import distributed
from train import data as data_lib
from train.kit import resume
from train.kit.devices import Devices


def open_data(
    settings: Any, devices: Devices, saved: dict | None, tokenizer: data_lib.Tokenizer | None = None
) -> tuple[data_lib.Dataset, dict]:
    """The dataset (prepared by process 0 if needed) and its fingerprint, which must be the checkpoint's when
    resuming: the same tokenizer and token files, or a clear error before anything is overwritten. Text is
    tokenized with `tokenizer` (a model's own) if given, else with a new one of kind `settings.tokenizer`."""
    tokenizer = tokenizer or settings.tokenizer
    try:
        if distributed.is_main():  # prepares the dataset if needed; the other processes wait, then open it
            data_lib.ensure_dataset(settings.dataset, tokenizer=tokenizer)
        devices.barrier("dataset ready")
        prepared = data_lib.ensure_dataset(settings.dataset, tokenizer=tokenizer, log=None)
        dataset = data_lib.open_dataset(prepared)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: dataset {settings.dataset!r}: {e}") from None
    shortest, block_size = min(len(dataset.train), len(dataset.val)), settings.block_size
    if block_size >= shortest:
        raise SystemExit(
            f"error: block_size={block_size} needs more than {block_size} tokens per split, "
            f"but the {'train' if len(dataset.train) == shortest else 'val'} split has {shortest}"
        )
    fingerprint = data_lib.fingerprint(dataset)
    say = print if distributed.is_main() else lambda line: None
    resume.check_data(saved, fingerprint, f"dataset {settings.dataset!r} ({dataset.path})", say)
    return dataset, fingerprint


def estimate_loss(
    eval_loss, params, dataset: data_lib.Dataset, settings: Any, iteration: int, devices: Devices = Devices()
) -> dict[str, float]:
    """Mean loss over `eval_iters` batches of each split, without dropout; streams 1 and 2 of the batch
    sampler, so the estimate never changes the training batches. The batches are dispatched back to back and
    their losses read once per split (summed as Python floats on the host: no program of its own to compile)."""
    out, rows = {}, devices.local_rows(settings.batch_size)
    for stream, (name, split) in enumerate((("train_loss", dataset.train), ("val_loss", dataset.val)), start=1):
        losses = []
        for k in range(settings.eval_iters):
            index = iteration * settings.eval_iters + k
            batch = data_lib.get_batch(
                split, settings.batch_size, settings.block_size, settings.seed, index, stream, rows
            )
            losses.append(eval_loss(params, *devices.put_batch(batch, settings.batch_size)))
        out[name] = sum(float(loss) for loss in jax.device_get(losses)) / settings.eval_iters
    return out


def load_gpt2(
    directory: str, block_size: int, *, dropout: float, layers: str, remat: str = "none"
) -> tuple[dict, gpt.GPTConfig]:
    """For --init_from=<dir>: GPT-2's params and config from a Hugging Face directory, trained with `dropout`,
    `layers` and `remat`, cropped to `block_size`."""
    if not (Path(directory) / "config.json").exists():
        raise SystemExit(
            f"error: --init_from={directory!r} is not 'scratch', 'resume' or a Hugging Face "
            f"GPT-2 directory (no config.json there)"
        )
    from models import gpt_hf

    params, model_config = gpt_hf.load(Path(directory))
    model_config = dataclasses.replace(model_config, dropout=dropout, layers=layers, remat=remat)
    return gpt_surgery.crop_block_size(params, model_config, min(block_size, model_config.block_size))


def model_tokenizer(directory: str | Path) -> data_lib.Tokenizer | None:
    """The tokenizer a Hugging Face directory (or a train.gpt out_dir) holds, for the text to be tokenized as the
    model was trained: its tokenizer.json, or GPT-2's vocab.json + merges.txt; None when it holds neither."""
    directory = Path(directory)
    try:
        if (directory / "tokenizer.json").is_file():
            return data_lib.load_tokenizer(directory / "tokenizer.json")
        if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            return data_lib.BPETokenizer.from_gpt2_files(directory / "vocab.json", directory / "merges.txt")
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: the tokenizer in {str(directory)!r} cannot be read: {e}") from None
    return None


def resumed_tokenizer(out_dir: str | Path, saved: dict) -> data_lib.Tokenizer | None:
    """For --init_from=resume: the tokenizer saved in `out_dir` when the checkpoint's data was tokenized with a
    model's own BPE (so the text is tokenized the same way again); None for a char or byte one, made anew."""
    recorded = (saved.get("data") or {}).get("tokenizer") or {}
    return model_tokenizer(out_dir) if recorded.get("kind") == "bpe" else None


def check_untokenized_import(directory: str, tokenizer: data_lib.Tokenizer, model_config: gpt.GPTConfig) -> None:
    """For --init_from=<dir> holding no tokenizer: the dataset's own tokenizer stands in for the model's, which
    is refused unless the vocabulary sizes agree, and then warned about: its ids are not the model's tokens."""
    if tokenizer.vocab_size != model_config.vocab_size:
        raise SystemExit(
            f"error: --init_from={directory!r} holds no tokenizer (tokenizer.json, or vocab.json + merges.txt), "
            f"and the dataset's {tokenizer.kind} tokenizer has {tokenizer.vocab_size} tokens where the model has "
            f"{model_config.vocab_size}; put the model's own tokenizer in {directory!r}"
        )
    if distributed.is_main():
        print(
            f"warning: --init_from={directory!r} holds no tokenizer: the ids of the dataset's {tokenizer.kind} "
            "tokenizer will not match the model's vocabulary"
        )


class LossEstimates:
    """The loss estimates of a run on text, due every `eval_interval` steps and at `max_iters`: the last one,
    the best val loss so far and the iteration last estimated, the latter two carried over a resume by the
    checkpoint's metadata (`best_val_loss`, and its `reason`: an "eval" or "end" checkpoint was saved right
    after estimating its iteration, which is then not estimated again; a "signal" one was not)."""

    def __init__(self, eval_loss, data: data_lib.Dataset, settings: Any, devices: Devices, resumed: Any, first: int):
        self.eval_loss, self.data, self.settings, self.devices = eval_loss, data, settings, devices
        metadata = dict(resumed.metadata) if resumed else {}
        self.best: float = metadata.get("best_val_loss", math.inf)
        self.at = first if resumed and metadata.get("reason") in ("eval", "end") else None
        self.last: dict[str, float] = {}

    def due(self, iteration: int) -> bool:
        scheduled = iteration % self.settings.eval_interval == 0 or iteration == self.settings.max_iters
        return scheduled and iteration != self.at

    def estimate(self, params: Any, iteration: int) -> bool:
        """Estimate both losses at `iteration` (`estimate_loss`) and keep them; whether the val loss improved."""
        self.last = estimate_loss(self.eval_loss, params, self.data, self.settings, iteration, self.devices)
        self.at, improved = iteration, self.last["val_loss"] < self.best
        self.best = min(self.best, self.last["val_loss"])
        return improved

    def line(self, iteration: int) -> str:
        return f"iter {iteration}: train loss {self.last['train_loss']:.4f}, val loss {self.last['val_loss']:.4f}"
