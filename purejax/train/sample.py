"""Sample from a trained GPT: nanoGPT's sample.py, with a key/value cache.

    python -m purejax.train.sample --out_dir=out-gpt --start="def " --num_samples=2 --max_new_tokens=300
    python -m purejax.train.sample --start=FILE:prompt.txt --temperature=0.8 --top_k=40 --top_p=0.95 --seed=7

Reads only the parameters from the newest checkpoint in out_dir (the optimizer state's bytes are never
read), and the tokenizer saved beside it. Generation compiles once for a given prompt length and number of
new tokens; see `models.gpt.generate`.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from purejax.models import gpt
from purejax import checkpoint
from purejax.train.data import load_tokenizer


def load_model(out_dir: str | Path, step: int | None = None) -> tuple[dict, gpt.GPTConfig, int]:
    """(params, config, step) from out_dir's newest (or `step`'s) readable checkpoint, params only."""
    manager = checkpoint.CheckpointManager(out_dir, keep_last=None)
    if step is None:
        step = manager.latest_step()
    if step is None:
        raise SystemExit(f"error: no checkpoint in {str(out_dir)!r}; train one with `python -m purejax.train.gpt --out_dir={out_dir}`")
    params, info = checkpoint.restore(manager.path(step), subtree="params")
    return jax.tree.map(jnp.asarray, params), gpt.GPTConfig(**info.config["model"]), step


def read_start(start: str) -> str:
    """The prompt: the string itself, or a file's text for `FILE:path` (nanoGPT's convention)."""
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise SystemExit(f"error: --start={start!r}: no such file {str(path)!r}")
        return path.read_text(encoding="utf-8")
    return start


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out-gpt")
    parser.add_argument("--start", default="\n", help='the prompt, or "FILE:path" to read it from a file')
    parser.add_argument("--num_samples", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 takes the most likely token")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--step", type=int, default=None, help="a checkpoint's step (default: the newest)")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 0:
        parser.error("--num_samples must be >= 1 and --max_new_tokens >= 0")

    tokenizer_path = Path(args.out_dir) / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SystemExit(f"error: no tokenizer.json in {args.out_dir!r}: is it a train.gpt out_dir?")
    tokenizer = load_tokenizer(tokenizer_path)
    params, config, step = load_model(args.out_dir, args.step)
    if config.vocab_size > tokenizer.vocab_size:  # padded (for tensor parallelism): never sample a padding id
        params, config = gpt.crop_vocab(params, config, tokenizer.vocab_size)
    try:
        ids = tokenizer.encode(read_start(args.start))
    except ValueError as e:
        raise SystemExit(f"error: the prompt cannot be encoded with this model's tokenizer: {e}") from None
    if len(ids) == 0:
        raise SystemExit("error: the prompt is empty; give at least one character")
    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (args.num_samples, 1)))
    try:
        generate_args = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p)  # fmt: skip
        start = time.perf_counter()
        out = gpt.generate(params, prompt, config, jax.random.key(args.seed), **generate_args)
        out = np.asarray(out)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(row) for row in out]
    print(f"checkpoint {step}; {args.num_samples} x {args.max_new_tokens} tokens in {seconds:.1f} s (compile included)",
          file=sys.stderr)  # fmt: skip
    for text in texts:
        print(text)
        print("-" * 40)
    return texts


if __name__ == "__main__":
    main()
