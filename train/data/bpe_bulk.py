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
  the `▁` put in front. A "metaspace"-style text that splits into words at each `▁` is always cut there.
- **who encodes the pieces.** tiktoken, when it is installed and proven to give the same ids, or Hugging Face
  `tokenizers` when asked (`bpe_fast.py` chooses): each piece cut again into texts of about
  `FAST_PIECE_CHARS` characters that they encode on every core. Otherwise `workers` processes of the
  readable encoder.
- **a stream.** `cut` takes the text as chunks and holds one piece at a time, and `encode_pieces` keeps at
  most two pieces per process in flight, so `prepare` (train/data/prepare.py) encodes a corpus larger than
  memory. A char or byte tokenizer's text is cut anywhere.

The tests check the ids against `encode` on hostile text in each style, both ways.
"""

import collections
import multiprocessing
import re
from collections.abc import Iterable, Iterator

import numpy as np

from train.data.bpe import SPACE_MARK, BPETokenizer
from train.data.bpe_fast import TextsEncoder, fast_encoder
from train.data.bpe_files import MARKED_SPACES
from train.data.bpe_split import checked_text
from train.data.tokenizers import Tokenizer

PIECE_CHARS = 1 << 20  # about a megabyte of text per piece
FAST_PIECE_CHARS = 1 << 13  # a piece cut again into texts of about 8 kB for tiktoken's and Hugging Face's batches
WORD_CUT = re.compile(r"(?<=[^\s\n])\n(?=[^\s\n])")  # a newline between two characters that are not white space
_SPACE_CUT = re.compile(r"(?<=[^ ])(?= )")  # just before a space that follows another character
_ANYWHERE = re.compile(r"(?s)(?<=.)")  # after any character: a char or byte tokenizer encodes each on its own


def cut_pattern(tokenizer: Tokenizer) -> re.Pattern | None:
    """Where `tokenizer`'s text may be cut so that the pieces' ids, joined, are the whole text's; None: nowhere
    (a "sentencepiece"-style BPE with a merge that joins a symbol ending in another character to one starting
    with `▁`, which a cut before a space could split)."""
    if not isinstance(tokenizer, BPETokenizer):
        return _ANYWHERE
    if tokenizer.style not in MARKED_SPACES:
        return WORD_CUT
    if tokenizer.style == "metaspace" and tokenizer.split:  # its words start at `▁`: no merge crosses one
        return _SPACE_CUT
    if any(not left.endswith(SPACE_MARK) and right.startswith(SPACE_MARK) for left, right in tokenizer.merges):
        return None
    return _SPACE_CUT


def cut(chunks: Iterable[str], where: re.Pattern | None, size: int = PIECE_CHARS) -> Iterator[str]:
    """The text of `chunks` (in order) as pieces cut at the first match of `where` after every `size`
    characters, each cut at the match's end; one piece when `where` is None. Holds one piece and a chunk at a
    time, so a stream larger than memory goes through."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        start = 0
        while where is not None and len(buffer) - start > size:
            found = where.search(buffer, start + size)
            if found is None:
                break
            yield buffer[start : found.end()]
            start = found.end()
        buffer = buffer[start:]
    if buffer:
        yield buffer


def pieces(tokenizer: Tokenizer, text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut, at the first safe place after every `size` characters, into pieces that encode to the
    whole text's ids (`cut_pattern` says where that is)."""
    return list(cut([text], cut_pattern(tokenizer), size))


def _encode(tokenizer: Tokenizer, text: str, first: bool = True) -> np.ndarray:
    """The ids of a piece: `encode`, or for a later piece of a `▁`-style text its words without the `▁` put in
    front of the text (`continuation_ids`)."""
    if first or getattr(tokenizer, "style", None) not in MARKED_SPACES:
        return np.asarray(tokenizer.encode(text), np.int64)
    return np.asarray(tokenizer.continuation_ids(text), np.int64)


_worker_tokenizer: Tokenizer | None = None  # in an encoding process: the tokenizer, handed over once


def _hold_tokenizer(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(text: str, first: bool) -> np.ndarray:
    return _encode(_worker_tokenizer, text, first)


def encode_pieces(
    tokenizer: Tokenizer, texts: Iterable[str], *, workers: int = 1, fast: TextsEncoder | None = None
) -> Iterator[np.ndarray]:
    """The ids of each of `texts` (pieces of one text, in order: the first is its start), in order, encoded by
    `fast` (one of `bpe_fast.fast_encoder`'s, for a byte-level BPE only: each piece is cut again at WORD_CUT),
    or else by the readable encoder in this process or in `workers` spawned ones. At most two pieces per process
    are in flight, so the pieces can come from a stream larger than memory."""
    if fast is not None:
        for text in texts:
            yield fast(list(cut([text], WORD_CUT, FAST_PIECE_CHARS)))
        return
    if workers <= 1:
        for i, text in enumerate(texts):
            yield _encode(tokenizer, text, i == 0)
        return
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, initializer=_hold_tokenizer, initargs=(tokenizer,)) as pool:
        in_flight: collections.deque = collections.deque()
        for i, text in enumerate(texts):
            in_flight.append(pool.apply_async(_encode_in_worker, (text, i == 0)))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def encode_corpus(
    tokenizer: BPETokenizer,
    text: str | bytes,
    *,
    workers: int = 1,
    encoder: str = "auto",
    piece_chars: int = PIECE_CHARS,
) -> np.ndarray:
    """The ids of `text` (str, or UTF-8 bytes), equal to `tokenizer.encode(text)`: by the `encoder` of
    `bpe_fast.ENCODERS` ("auto": tiktoken when it is installed and exact, else the readable encoder in
    `workers` processes, 1: this one), in pieces of about `piece_chars` characters."""
    parts = pieces(tokenizer, checked_text(text), piece_chars)
    fast = fast_encoder(tokenizer, encoder)[1]
    ids = list(encode_pieces(tokenizer, parts, workers=workers if len(parts) > 1 else 1, fast=fast))
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)
