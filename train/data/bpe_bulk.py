"""Encoding a whole corpus with a BPE: the same ids as `BPETokenizer.encode(text)`, faster.

`BPETokenizer.encode` is the reference, written to be read, and runs in one Python process. A corpus is
encoded in pieces instead, and the pieces at once:

- **where to cut.** Merges never cross a word boundary, so a corpus may be cut where the word pattern always
  ends a word whatever surrounds it: after a newline that sits between two characters that are not white space
  ("x\\ny"). GPT-2's and Llama 3's patterns both end a word there (the newline is a word of its own, or ends
  a run of punctuation), so the pieces' ids, joined, are the whole text's. A "sentencepiece"-style tokenizer
  (Llama 2) has no words: its text, `▁` in front and every space a `▁`, is one. It is cut before a space that
  follows another character only when no merge joins a symbol ending in another character to one starting
  with `▁` (SentencePiece, splitting at white space as it does by default, never learns one; the merges are
  checked, not assumed): then no merge crosses such a cut. The pieces after the first are encoded without
  the `▁` put in front.
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

from train.data.bpe import SPACE_MARK, BPETokenizer
from train.data.bpe_split import checked_text

PIECE_CHARS = 1 << 20  # about a megabyte of text per piece
_CUT = re.compile(r"(?<=[^\s\n])\n(?=[^\s\n])")  # a newline between two characters that are not white space
_SPACE_CUT = re.compile(r"(?<=[^ ])(?= )")  # just before a space that follows another character


def pieces(text: str, style: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut, at the first safe place after every `size` characters, into pieces that encode to the
    whole text's ids; the whole text for "sentencepiece" style (`sentencepiece_pieces` says when it cuts)."""
    if style == "sentencepiece":
        return [text]
    return _cut(text, _CUT, size)


def sentencepiece_pieces(tokenizer: BPETokenizer, text: str, size: int = PIECE_CHARS) -> list[str]:
    """A "sentencepiece"-style text cut before a space that follows another character, about every `size`
    characters, when no merge joins a symbol ending in another character to one starting with `▁` (so none
    crosses the cut); the whole text otherwise."""
    if any(not left.endswith(SPACE_MARK) and right.startswith(SPACE_MARK) for left, right in tokenizer.merges):
        return [text]
    return _cut(text, _SPACE_CUT, size)


def _cut(text: str, where: re.Pattern, size: int) -> list[str]:
    """`text` cut at the first match of `where` after every `size` characters, each cut at the match's end."""
    out, start = [], 0
    while len(text) - start > size:
        cut = where.search(text, start + size)
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


def _encode(tokenizer: BPETokenizer, text: str, first: bool = True) -> np.ndarray:
    """The ids of a piece: `encode`, or for a later piece of a "sentencepiece"-style text its one word
    without the `▁` put in front of the text."""
    if first or tokenizer.style != "sentencepiece":
        return np.asarray(tokenizer.encode(text), np.int64)
    return np.asarray(tokenizer.word_ids(text.replace(" ", SPACE_MARK)), np.int64)


def encode_corpus(
    tokenizer: BPETokenizer, text: str | bytes, *, workers: int = 1, fast: bool = False, piece_chars: int = PIECE_CHARS
) -> np.ndarray:
    """The ids of `text` (str, or UTF-8 bytes), equal to `tokenizer.encode(text)`: the readable encoder in
    `workers` processes (1: this one), or Hugging Face `tokenizers` when `fast` and it is installed; in pieces
    of about `piece_chars` characters."""
    text = checked_text(text)
    encoder = hugging_face_encoder(tokenizer) if fast else None
    if encoder is not None:  # Hugging Face puts a `▁` in front of every piece: a sentencepiece text goes whole
        ids = [np.asarray(part, np.int64) for part in encoder(pieces(text, tokenizer.style, piece_chars))]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if tokenizer.style == "sentencepiece":
        parts = sentencepiece_pieces(tokenizer, text, piece_chars)
    else:
        parts = pieces(text, tokenizer.style, piece_chars)
    jobs = [(tokenizer, part, i == 0) for i, part in enumerate(parts)]
    if workers > 1 and len(parts) > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            ids = pool.starmap(_encode, jobs)
    else:
        ids = [_encode(*job) for job in jobs]
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)
