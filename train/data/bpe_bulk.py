"""Encoding a whole corpus with a BPE: the same ids as `BPETokenizer.encode(text)`, faster.

`BPETokenizer.encode` is the reference, written to be read, and runs in one Python process. A corpus is
encoded in pieces instead, and the pieces at once:

- **where to cut.** Merges never cross a word boundary, so a corpus may be cut where the word pattern always
  ends a word whatever surrounds it: after a newline that sits between two characters that are not white space
  ("x\\ny"). GPT-2's and Llama 3's patterns both end a word there (the newline is a word of its own, or ends
  a run of punctuation), so the pieces' ids, joined, are the whole text's. A "sentencepiece"-style tokenizer
  (Llama 2) puts `▁` in front of the text and has no words: its text is never cut.
- **who encodes the pieces.** `workers` processes of the readable encoder; or, with `fast=True` and Hugging
  Face `tokenizers` installed (an optional extra, never a run-time dependency), its `encode_batch` over
  threads, the tokenizer handed over as its own tokenizer.json with `encode_special_tokens` on, so a special
  token's string in the text is text, as `encode` treats it. On the built-in corpus the readable encoder
  (which caches the words it has seen) outran `tokenizers`, so it is the default (docs/benchmarks.md,
  `python -m bench.tokenize`).

The tests check the ids against `encode` on hostile text in each style, both ways.
"""

import json
import multiprocessing
import re
from collections.abc import Callable

import numpy as np

from train.data.bpe import BPETokenizer
from train.data.bpe_split import checked_text

PIECE_CHARS = 1 << 20  # about a megabyte of text per piece
_CUT = re.compile(r"(?<=[^\s\n])\n(?=[^\s\n])")  # a newline between two characters that are not white space


def pieces(text: str, style: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut, at the first safe place after every `size` characters, into pieces that encode to the
    whole text's ids; the whole text for "sentencepiece" style (a `▁` goes in front of each piece)."""
    if style == "sentencepiece" or len(text) <= size:
        return [text]
    out, start = [], 0
    while len(text) - start > size:
        cut = _CUT.search(text, start + size)
        if cut is None:
            break
        out.append(text[start : cut.end()])
        start = cut.end()
    out.append(text[start:])
    return out


def hugging_face_encoder(tokenizer: BPETokenizer) -> Callable[[list[str]], list[list[int]]] | None:
    """`encode_batch` of Hugging Face's tokenizer built from `tokenizer`'s tokenizer.json, special-token strings
    read as text; None when `tokenizers` is not installed."""
    try:
        import tokenizers
    except ImportError:
        return None
    fast = tokenizers.Tokenizer.from_str(json.dumps(tokenizer.to_json()))
    fast.encode_special_tokens = True
    return lambda texts: [encoding.ids for encoding in fast.encode_batch(texts, add_special_tokens=False)]


def _encode(tokenizer: BPETokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), np.int64)


def encode_corpus(
    tokenizer: BPETokenizer, text: str | bytes, *, workers: int = 1, fast: bool = False, piece_chars: int = PIECE_CHARS
) -> np.ndarray:
    """The ids of `text` (str, or UTF-8 bytes), equal to `tokenizer.encode(text)`: the readable encoder in
    `workers` processes (1: this one), or Hugging Face `tokenizers` when `fast` and it is installed; in pieces
    of about `piece_chars` characters."""
    parts = pieces(checked_text(text), tokenizer.style, piece_chars)
    encoder = hugging_face_encoder(tokenizer) if fast else None
    if encoder is not None:
        ids = [np.asarray(part, np.int64) for part in encoder(parts)]
    elif workers > 1 and len(parts) > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            ids = pool.starmap(_encode, [(tokenizer, part) for part in parts])
    else:
        ids = [_encode(tokenizer, part) for part in parts]
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)
