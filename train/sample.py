"""Sample from a trained GPT: nanoGPT's sample.py, with a key/value cache.

    python -m train.sample --out_dir=out-gpt --start="def " --num_samples=2 --max_new_tokens=300
    python -m train.sample --start=FILE:prompt.txt --temperature=0.8 --top_k=40 --top_p=0.95 --seed=7
    python -m train.sample --help            # every setting, its default and range

Reads only the parameters of the newest readable checkpoint in out_dir (or `--step`'s; the optimizer state's
bytes are never read, and a damaged newest file is skipped with a warning), and the tokenizer saved beside it.
Generation compiles once per prompt length (and multiple of block_size); see `models.gpt_decode.generate`.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import gpt_decode, gpt_surgery
from train.data import load_tokenizer
from train.kit import settings as settings_lib
from train.kit.settings import setting
from train.kit.trained import load_model


@dataclass(frozen=True)
class SampleConfig:
    """Every setting of `python -m train.sample`."""

    out_dir: str = setting("out-gpt", "the train.gpt out_dir: its checkpoints and tokenizer.json")
    start: str = setting("\n", "the prompt, or FILE:path to read it from a file")
    num_samples: int = setting(2, "samples to draw, in one batch", at_least=1)
    max_new_tokens: int = setting(300, "tokens generated per sample", at_least=0)
    temperature: float = setting(0.8, "divides the logits; 0 takes the most likely token", at_least=0)
    top_k: int | None = setting(None, "sample among the k most likely tokens (none: all)", at_least=1)
    top_p: float | None = setting(
        None, "sample among the most likely tokens holding this probability (none: all)", above=0, at_most=1
    )
    seed: int = setting(1337, "the seed of the sampling", at_least=0, below=2**32)
    step: int | None = setting(None, "the checkpoint's step (none: the newest readable one)", at_least=0)

    def __post_init__(self):
        settings_lib.check_ranges(self)


def read_start(start: str) -> str:
    """The prompt: the string itself, or a file's text for `FILE:path` (nanoGPT's convention)."""
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise SystemExit(f"error: --start={start!r}: no such file {str(path)!r}")
        return path.read_text(encoding="utf-8")
    return start


def main(argv: list[str] | None = None) -> list[str]:
    argv = sys.argv[1:] if argv is None else argv
    settings = settings_lib.command_line(SampleConfig, argv, prog="train.sample", doc=__doc__)
    tokenizer_path = Path(settings.out_dir) / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SystemExit(f"error: no tokenizer.json in {settings.out_dir!r}: is it a train.gpt out_dir?")
    tokenizer = load_tokenizer(tokenizer_path)
    params, config, step = load_model(settings.out_dir, settings.step)
    if config.vocab_size > tokenizer.vocab_size:  # padded (for tensor parallelism): never sample a padding id
        params, config = gpt_surgery.crop_vocab(params, config, tokenizer.vocab_size)
    try:
        ids = tokenizer.encode(read_start(settings.start))
    except ValueError as e:
        raise SystemExit(f"error: the prompt cannot be encoded with this model's tokenizer: {e}") from None
    if len(ids) == 0:
        raise SystemExit("error: the prompt is empty; give at least one character")
    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (settings.num_samples, 1)))
    try:
        start = time.perf_counter()
        sampling = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
        key = jax.random.key(settings.seed)
        out = gpt_decode.generate(params, prompt, config, key=key, max_new_tokens=settings.max_new_tokens, **sampling)
        out = np.asarray(out)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(row) for row in out]
    print(
        f"checkpoint {step}; {settings.num_samples} x {settings.max_new_tokens} tokens in {seconds:.1f} s "
        "(compile included)",
        file=sys.stderr,
    )
    for text in texts:
        print(text)
        print("-" * 40)
    return texts


if __name__ == "__main__":
    main()
