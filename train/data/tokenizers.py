"""Character-level and byte-level tokenizers, saved as plain JSON (never pickle).

A tokenizer turns text into integer ids and back. Two kinds, both small enough to read in a minute:

- `CharTokenizer`: one id per distinct character of the corpus, ids in sorted character order (nanoGPT's
  `shakespeare_char`). A small vocabulary (about 100 for English text), but it only knows the characters it
  was built from.
- `ByteTokenizer`: the 256 possible bytes of the UTF-8 encoding. It knows every text, at the price of
  several ids per non-ASCII character.

A third, `BPETokenizer` (byte-pair encoding, GPT-2 and Llama style), lives in `bpe.py`; it is saved in Hugging
Face's tokenizer.json layout instead, recognised by its "model" field.

`tokenizer.json` holds `{"kind": "char", "vocab": [...characters...]}` or `{"kind": "byte", "vocab_size": 256}`:
readable by any language, and loading it runs no code (nanoGPT's `meta.pkl` is a pickle, which can).
"""

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from train.data.bpe import BPETokenizer
from train.data.bpe_train import train_bpe
from train.data.token_ids import TokenIds
from train.data.token_ids import as_ids as _as_ids


@dataclass(frozen=True)
class CharTokenizer:
    """One id per character: `vocab[i]` is the character with id `i`.

    Arguments:
        vocab: the distinct single characters, in id order (`from_text` sorts them, as nanoGPT does).
    """

    vocab: tuple[str, ...]
    kind: ClassVar[str] = "char"
    # Derived in __post_init__ for the vectorised encode: the code points sorted, and the id of each.
    _sorted_points: np.ndarray = field(init=False, repr=False, compare=False)
    _sorted_ids: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "vocab", tuple(self.vocab))  # frozen: fields are set once, here
        bad = [c for c in self.vocab if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"a CharTokenizer vocabulary holds single characters, got {bad[:5]!r}")
        if len(set(self.vocab)) != len(self.vocab):
            repeated = sorted(c for c, n in Counter(self.vocab).items() if n > 1)
            raise ValueError(f"the vocabulary repeats characters {repeated[:10]!r}")
        if not self.vocab:
            raise ValueError("a CharTokenizer needs at least one character in its vocabulary")
        points = np.array([ord(c) for c in self.vocab], dtype=np.int64)
        order = np.argsort(points)
        object.__setattr__(self, "_sorted_points", points[order])
        object.__setattr__(self, "_sorted_ids", order)

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """The tokenizer of every character in `text` (or in its pieces), ids in sorted (code point) order."""
        return cls(tuple(sorted(set().union(*map(set, [text] if isinstance(text, str) else text)))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, unknown: str | None = None) -> TokenIds:
        """The ids of the characters of `text`.

        A character outside the vocabulary raises ValueError naming it, unless `unknown` is given: a
        character of the vocabulary (for example `"?"` or `" "`) that stands in for every unknown one.
        """
        # UTF-32 gives one 4-byte code unit per character; "surrogatepass" lets lone surrogates through.
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
        position = np.minimum(np.searchsorted(self._sorted_points, points), len(self.vocab) - 1)
        known = self._sorted_points[position] == points
        ids = self._sorted_ids[position]
        if not known.all():
            if unknown is None:
                where = np.flatnonzero(~known)
                chars = sorted({text[i] for i in where.tolist()})
                shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars[:10])
                raise ValueError(
                    f"{len(chars)} character(s) not in the vocabulary of {self.vocab_size}: {shown}; first at "
                    f"position {where[0]}. Pass unknown=<a character of the vocabulary> to replace them, or "
                    "prepare the dataset from text that contains them (or use the byte-level tokenizer)"
                )
            if unknown not in self.vocab:
                raise ValueError(f"the replacement unknown={unknown!r} is not in the vocabulary itself")
            ids = np.where(known, ids, self.vocab.index(unknown))
        return ids

    def decode(self, ids: ArrayLike) -> str:
        """The text of a 1-D sequence of ids (list, numpy or jax array)."""
        ids = _as_ids(ids, self.vocab_size)
        return "".join(np.array(self.vocab, dtype=object)[ids].tolist())

    def to_json(self) -> dict:
        return {"kind": self.kind, "vocab": list(self.vocab)}

    def save(self, path: str | Path) -> None:
        save_tokenizer(self, path)

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        return _load_kind(path, cls)


@dataclass(frozen=True)
class ByteTokenizer:
    """The UTF-8 bytes of the text: 256 ids, lossless for any text Python can encode as UTF-8."""

    kind: ClassVar[str] = "byte"
    vocab_size: ClassVar[int] = 256

    def encode(self, text: str) -> TokenIds:
        """The UTF-8 bytes of `text` as ids. Lone surrogates (not valid Unicode) raise ValueError."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode at position {e.start} ({e.reason}); cannot encode") from e
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: ArrayLike) -> str:
        """The text of a sequence of byte ids. A cut multi-byte character (a sample can stop in the middle
        of one) becomes U+FFFD instead of raising."""
        return _as_ids(ids, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    def save(self, path: str | Path) -> None:
        save_tokenizer(self, path)

    @classmethod
    def load(cls, path: str | Path) -> "ByteTokenizer":
        return _load_kind(path, cls)


Tokenizer = CharTokenizer | ByteTokenizer | BPETokenizer
KINDS: dict[str, type] = {"char": CharTokenizer, "byte": ByteTokenizer, "bpe": BPETokenizer}


def make_tokenizer(kind: str, text: str | Iterable[str], vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer of `kind` ("char", "byte", or "bpe": trained on `text` to `vocab_size` tokens) for `text`,
    the whole text or its pieces cut between words (`bpe_bulk.cut`)."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if vocab_size is None:
            raise ValueError("a bpe tokenizer is trained to a vocabulary size: give vocab_size (--vocab_size)")
        return train_bpe(text, vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {sorted(KINDS)}")


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write `tokenizer` to `path` as JSON (non-ASCII characters escaped, so any vocabulary round-trips)."""
    Path(path).write_text(json.dumps(tokenizer.to_json()) + "\n", encoding="utf-8")


def tokenizer_from_json(data: dict, source: str = "tokenizer JSON") -> Tokenizer:
    """The tokenizer described by a dict as written by `to_json`; `source` names it in errors. A BPE tokenizer is
    in Hugging Face's tokenizer.json layout, which holds a "model" instead of a "kind"."""
    if isinstance(data, dict) and "model" in data and "kind" not in data:
        return BPETokenizer.from_json(data, source)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in ("byte", "char"):
        raise ValueError(
            f"{source}: 'kind' must be one of ['byte', 'char'], got {kind!r} (a BPE tokenizer is a Hugging Face "
            "tokenizer.json, with a 'model' and no 'kind')"
        )
    if kind == "byte":
        if data.get("vocab_size", 256) != 256:
            raise ValueError(f"{source}: a byte tokenizer has vocab_size 256, got {data.get('vocab_size')!r}")
        return ByteTokenizer()
    if not isinstance(data.get("vocab"), list):
        raise ValueError(f"{source}: a char tokenizer needs 'vocab', a list of characters")
    try:
        return CharTokenizer(tuple(data["vocab"]))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved at `path` (a `tokenizer.json`), whichever its kind."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}; prepare the dataset with `python -m train.data`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON tokenizer file: {e}") from None
    return tokenizer_from_json(data, str(path))


def _load_kind(path: str | Path, cls: type) -> Tokenizer:
    tokenizer = load_tokenizer(path)
    if not isinstance(tokenizer, cls):
        raise ValueError(f"{path} holds a {tokenizer.kind!r} tokenizer, not a {cls.kind!r} one; use load_tokenizer")
    return tokenizer
