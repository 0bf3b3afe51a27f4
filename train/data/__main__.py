"""Prepare a dataset:

    python -m train.data [--input PATH] [--tokenizer char|byte|bpe|PATH] [--vocab_size N] [--out_dir D]

With no --input, the built-in corpus (Python's own documentation and source, no download) goes to
data/stdlib/. With one, a text file or a directory of text files goes to data/<its name>/ unless --out_dir
says otherwise. A byte tokenizer adds "-byte" to the default directory name, a BPE one "-bpe"; a BPE is trained
on the text to --vocab_size tokens (GPT-2 style, byte-level; at least 257), or read from a tokenizer.json
(--tokenizer PATH: a model's own). The text streams through, encoded by tiktoken on every core when it is
installed and proven to give this BPE's ids (--encoder auto), or else over --workers processes of the
readable encoder, with the same ids either way, and a progress line on stderr.
"""

import argparse
import os
import sys
from pathlib import Path

from train.data.bpe_fast import ENCODERS
from train.data.corpus import TEXT_EXTENSIONS, read_source, stdlib_corpus
from train.data.dataset import DEFAULT, default_dir
from train.data.prepare import prepare
from train.data.tokenizers import load_tokenizer


def make_parser() -> argparse.ArgumentParser:
    """The command line's settings, each with its help."""
    parser = argparse.ArgumentParser(
        prog="python -m train.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--input",
        type=Path,
        default=None,
        help=f"a text file, or a directory whose {' '.join(TEXT_EXTENSIONS)} files are read in sorted order "
        "(default: the built-in corpus)",
    )
    parser.add_argument(
        "--tokenizer",
        default="char",
        help="char (default), byte, bpe (trained on the text), or the path of a tokenizer.json to encode with "
        "(a model's own: GPT-2's or Llama's BPE, or one saved here)",
    )
    parser.add_argument("--vocab_size", type=int, default=None, help="the BPE's vocabulary size (--tokenizer bpe)")
    parser.add_argument("--out_dir", type=Path, default=None, help="default: data/stdlib or data/<input name>")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes of the readable encoder for a large text, a piece of about a megabyte each (default: the "
        "cores)",
    )
    parser.add_argument(
        "--encoder",
        choices=ENCODERS,
        default="auto",
        help="who encodes a BPE's text: auto (default: tiktoken when it is installed and gives this BPE's ids, "
        "else readable), tiktoken, tokenizers (Hugging Face's), or readable (the reference, over --workers "
        "processes); the ids are the same",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Run the command line; returns the written meta.json contents. Errors exit with status 2."""
    parser = make_parser()
    args = parser.parse_args(argv)

    if args.tokenizer not in ("char", "byte", "bpe") and not Path(args.tokenizer).is_file():
        parser.error(f"--tokenizer {args.tokenizer!r} is not char, byte, bpe, nor a tokenizer.json file")
    if (args.vocab_size is None) != (args.tokenizer != "bpe"):
        parser.error("--vocab_size goes with --tokenizer bpe, and only with it")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        if args.input is None:
            source, name = stdlib_corpus(), DEFAULT
        else:
            if not args.input.exists():
                raise FileNotFoundError(f"input path {args.input} does not exist (expected a text file or directory)")
            source, name = read_source(args.input), args.input.resolve().stem or "text"
        given = None if args.tokenizer in ("char", "byte", "bpe") else load_tokenizer(args.tokenizer)
        out_dir = args.out_dir or default_dir("data", name, given.kind if given else args.tokenizer)
        tokenizer = given or args.tokenizer
        meta = prepare(
            source, out_dir, tokenizer, args.vocab_size, workers=args.workers, progress=True, encoder=args.encoder
        )
    except (OSError, ValueError, ImportError) as e:
        parser.exit(2, f"python -m train.data: error: {e}\n")
    print(f"{meta['source']}: {meta['text_chars']:,} characters")
    print(
        f"wrote {out_dir}: {meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}; "
        f"{meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens"
    )
    return meta


if __name__ == "__main__":
    main(sys.argv[1:])
