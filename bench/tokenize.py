"""Encoding a corpus with a BPE: megabytes of text per second, side by side on the same text and tokenizer.

    python -m bench.tokenize --repeats 3          # the built-in corpus, a BPE of 2,000 tokens trained on it
    python -m bench.tokenize --input my.txt --vocab_size 8000

The tokenizer is trained on the text by `train_bpe` (GPT-2 style, byte-level). The contenders, each given a
fresh tokenizer per call (the readable encoder caches the words it has seen, and a cache warmed by an earlier
call would flatter it):

    readable            BPETokenizer.encode(text): the reference, one Python process
    bulk, N processes   bpe_bulk.encode_corpus(encoder="readable", workers=N): pieces over N spawned processes
    bulk, tiktoken      bpe_bulk.encode_corpus(encoder="tiktoken"), the default where tiktoken is installed:
                        pieces cut again into texts of about 8 kB, tiktoken given the whole tokens (exact)
    bulk, tokenizers    bpe_bulk.encode_corpus(encoder="tokenizers"): the same texts through Hugging Face
                        tokenizers' encode_batch
    tokenizers          Hugging Face tokenizers alone, the same tokenizer.json: encode(text) in one call
    tiktoken            tiktoken (bench extra) as a user would set it up, every token ranked by its id, GPT-2's
                        pattern: encode_ordinary_batch over megabyte pieces, on every core

Every contender's ids are checked against the readable encoder's ("same ids"). Medians of `repeats`
interleaved samples. docs/benchmarks.md has the table.
"""

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from train.data import bpe_bulk, train_bpe
from train.data.bpe import BPETokenizer
from train.data.bpe_split import GPT2_PATTERN, bytes_to_unicode
from train.data.corpus import read_source, stdlib_corpus


def tiktoken_encoding(tokenizer: BPETokenizer):
    """tiktoken's `Encoding` of a GPT-2-style `tokenizer` as a user would set it up: each token's bytes ranked by
    its id, every token included, so its ids are not promised equal to BPE's (train/data/bpe_tiktoken.py says
    when they are); None without tiktoken."""
    try:
        import tiktoken
    except ImportError:
        return None
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {
        bytes(byte_of[c] for c in token): i
        for token, i in tokenizer.vocab.items()
        if token not in tokenizer.special_tokens
    }
    # tiktoken's pattern syntax is the regex module's: GPT-2's \p{L} and \p{N} as they are
    return tiktoken.Encoding("bench", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def tiktoken_encoder(tokenizer: BPETokenizer) -> Callable[[str], list[int]] | None:
    """encode(text) with `tiktoken_encoding`: the text cut into bpe_bulk's pieces, `encode_ordinary_batch` over
    them on every core; None without tiktoken."""
    encoding = tiktoken_encoding(tokenizer)
    if encoding is None:
        return None
    threads = os.cpu_count() or 1

    def encode(text: str) -> list[int]:
        parts = bpe_bulk.pieces(tokenizer, text)
        return [i for ids in encoding.encode_ordinary_batch(parts, num_threads=threads) for i in ids]

    return encode


def contenders(data: dict, workers: int) -> dict[str, Callable[[str], object]]:
    """name -> encode(text), each making its tokenizer afresh from the tokenizer.json `data`."""
    fresh = lambda: BPETokenizer.from_json(data)  # noqa: E731
    out = {
        "readable": lambda text: fresh().encode(text),
        f"bulk, {workers} processes": lambda text: bpe_bulk.encode_corpus(
            fresh(), text, workers=workers, encoder="readable"
        ),
    }
    if importlib.util.find_spec("tiktoken"):
        out["bulk, tiktoken"] = lambda text: bpe_bulk.encode_corpus(fresh(), text, encoder="tiktoken")
    if importlib.util.find_spec("tokenizers"):
        import tokenizers

        out["bulk, tokenizers"] = lambda text: bpe_bulk.encode_corpus(fresh(), text, encoder="tokenizers")

        def hugging_face(text: str) -> list[int]:
            fast = tokenizers.Tokenizer.from_str(json.dumps(data))
            fast.encode_special_tokens = True
            return fast.encode(text, add_special_tokens=False).ids

        out["tokenizers, one call"] = hugging_face
    if tiktoken_encoder(fresh()) is not None:
        out["tiktoken, batch"] = lambda text: tiktoken_encoder(fresh())(text)
    return out


def measure(fns: dict[str, Callable], text: str, repeats: int) -> dict[str, tuple[float, bool]]:
    """name -> (median seconds, whether its ids equal the first contender's), sampled interleaved."""
    want = np.asarray(next(iter(fns.values()))(text))
    same = {name: bool(np.array_equal(np.asarray(fn(text)), want)) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(text)
            samples[name].append(time.perf_counter() - start)
    return {name: (statistics.median(s), same[name]) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=None, help="a text file or directory (default: built-in)")
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    text = (read_source(args.input) if args.input else stdlib_corpus()).read_text()
    data = train_bpe(text, args.vocab_size).to_json()
    megabytes = len(text.encode("utf-8")) / 1e6
    results = measure(contenders(data, args.workers), text, args.repeats)
    readable = results["readable"][0]
    print(f"{megabytes:.2f} MB of text, a BPE of {args.vocab_size} tokens, {os.cpu_count()} cores")
    print("| encoder | s | MB/s | x readable | same ids |")
    print("|---|---:|---:|---:|---|")
    for name, (seconds, same) in results.items():
        rate, ratio = megabytes / seconds, readable / seconds
        print(f"| {name} | {seconds:.2f} | {rate:.2f} | {ratio:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
