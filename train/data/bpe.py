"""Byte-pair encoding (Sennrich et al. 2016; GPT-2's byte-level form), written out to be read.

A BPE vocabulary is a list of merges, in the order they were learned: `("h", "e")` then `("he", "llo")`...
Encoding a word starts from its smallest pieces and applies, again and again, the merge of lowest rank
(learned earliest) among the adjacent pairs, at its leftmost occurrence, until no adjacent pair is a merge;
each remaining piece is a token of the vocabulary. The steps, in the order text flows through them:

1. special tokens (`<|endoftext|>`, `<s>`) are cut out first, and only those `allowed_special` names: in
   ordinary text the string `<|endoftext|>` is just characters (tiktoken's rule; Hugging Face's
   `encode_special_tokens=True`), so a document cannot forge a document boundary;
2. each remaining piece is cut into words, which merges never cross (`bpe_split.py`):
   - "gpt2" and "llama3" (byte-level): GPT-2's or Llama 3's regular expression; each word's UTF-8 bytes are
     spelled in GPT-2's byte alphabet (a space is `Ġ`), so every text encodes and nothing is unknown;
   - "sentencepiece" (Llama 2 as Hugging Face writes it): the piece gets `▁` in front and each space becomes
     `▁`, and the whole piece is one word of characters; a character outside the vocabulary becomes its UTF-8
     bytes as `<0xE2>`-style tokens (byte fallback) or the unknown token;
   - "metaspace" (Hugging Face's Metaspace pre-tokenizer, as Mistral's and newer Llama conversions ship):
     each space becomes `▁`, a `▁` goes in front of a piece not already starting with one (`prepend_scheme`
     "always"; "first": only at the start of the text; "never"), and with `split` the text is cut into words
     before each `▁` (else it is one word, as "sentencepiece"); characters as in "sentencepiece";
3. each word is merged (a cache keeps the ids of words already seen, up to `CACHED_WORDS` of them, so memory
   stays bounded on a corpus of any size) and looked up in the vocabulary.
   With `ignore_merges` (Llama 3), a word that is itself a token is taken whole.

The file formats (GPT-2's vocab.json + merges.txt, Hugging Face's tokenizer.json) are in `bpe_files.py`,
training in `bpe_train.py`.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from train.data import bpe_files
from train.data.bpe_split import bytes_to_unicode, checked_text, split_special, split_words
from train.data.token_ids import TokenIds, as_ids

STYLES = ("gpt2", "llama3", "sentencepiece", "metaspace")
SPACE_MARK = "▁"  # U+2581, SentencePiece's visible space
MARKED_WORDS = re.compile(f"{SPACE_MARK}[^{SPACE_MARK}]*|[^{SPACE_MARK}]+")  # Metaspace's split: `▁` starts a word
CACHED_WORDS = 1 << 20  # the most words whose ids are kept; the frequent ones come back at once after a clear
BYTE_TOKEN = r"<0x[0-9A-F]{2}>"  # a byte-fallback token, `<0x00>`..`<0xFF>` (SentencePiece spells them upper case)


def merge_word(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply the merges of `ranks` to `symbols`: the leftmost occurrence of the lowest-ranked adjacent pair,
    again and again, until no adjacent pair is a merge. This is Hugging Face's order. GPT-2's `encoder.py`
    merges every occurrence of that pair at once, which gives the same pieces when each merge's parts were
    made by earlier merges (a new pair then always ranks higher), as in GPT-2's own files; a file that lists
    merges out of that order ("aa"+"a" before "a"+"a") is encoded as Hugging Face encodes it."""
    symbols = list(symbols)
    while len(symbols) > 1:
        pair_ranks = [ranks.get(pair, math.inf) for pair in zip(symbols, symbols[1:])]
        lowest = min(pair_ranks)
        if lowest == math.inf:
            break
        i = pair_ranks.index(lowest)  # the leftmost
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


@dataclass(frozen=True)
class BPETokenizer:
    """A byte-pair-encoding tokenizer. Load one with `from_json` (a Hugging Face tokenizer.json) or
    `from_gpt2_files` (vocab.json + merges.txt), or train one with `bpe_train.train_bpe`.

    Arguments:
        vocab: each token of the model to its id (byte-level tokens spelled in GPT-2's byte alphabet).
        merges: the merges, lowest rank (learned first) first; each part and their join are tokens of `vocab`.
        special_tokens: strings matched whole before anything else, when `encode` allows them, to their ids.
        style: how text becomes words: "gpt2", "llama3" (byte-level), "sentencepiece" or "metaspace" (see the
            module).
        ignore_merges: take a word that is itself a token whole, without merging (Llama 3).
        unk_token: the token for a character with no token and no byte fallback (`▁` styles only).
        byte_fallback: spell such a character as its UTF-8 bytes, `<0x00>`..`<0xFF>` (`▁` styles only).
        fuse_unk: one unknown token for a run of unknown characters.
        prepend_scheme: where "metaspace" puts a `▁` in front: "always", "first" (the start of the text only,
            not after a special token) or "never".
        split: whether "metaspace" cuts the text into words before each `▁`.
    """

    vocab: dict[str, int]
    merges: tuple[tuple[str, str], ...]
    special_tokens: dict[str, int] = field(default_factory=dict)
    style: str = "gpt2"
    ignore_merges: bool = False
    unk_token: str | None = None
    byte_fallback: bool = False
    fuse_unk: bool = False
    prepend_scheme: str = "always"
    split: bool = True
    kind: ClassVar[str] = "bpe"
    # Derived in __post_init__: the rank of each merge, the bytes of each id, and a cache of encoded words.
    _ranks: dict = field(init=False, repr=False, compare=False)
    _id_bytes: list = field(init=False, repr=False, compare=False)
    _cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "vocab", dict(self.vocab))  # copies: frozen means no one else edits them
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))
        object.__setattr__(self, "merges", tuple(tuple(pair) for pair in self.merges))
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")
        if self.prepend_scheme not in bpe_files.PREPEND_SCHEMES:
            raise ValueError(f"prepend_scheme must be one of {bpe_files.PREPEND_SCHEMES}, got {self.prepend_scheme!r}")
        for rank, (left, right) in enumerate(self.merges):
            missing = [t for t in (left, right, left + right) if t not in self.vocab]
            if missing:
                raise ValueError(f"merge {rank} ({left!r}, {right!r}) uses {missing[0]!r}, not in the vocabulary")
        if self.unk_token is not None and self.unk_token not in self.vocab:
            raise ValueError(f"unk_token {self.unk_token!r} is not in the vocabulary")
        ranks = {pair: rank for rank, pair in enumerate(self.merges)}  # a repeated merge: its last, as GPT-2 and HF
        object.__setattr__(self, "_ranks", ranks)
        object.__setattr__(self, "_id_bytes", self._bytes_of_ids())
        object.__setattr__(self, "_cache", {})

    def _bytes_of_ids(self) -> list[bytes]:
        """What each id decodes to, checking that the ids run from 0 without a gap or a clash."""
        by_id: dict[int, bytes] = {}
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        for token, token_id in self.vocab.items():
            if self.style in bpe_files.MARKED_SPACES:
                if self.byte_fallback and re.fullmatch(BYTE_TOKEN, token):
                    by_id[token_id] = bytes([int(token[3:5], 16)])
                else:
                    by_id[token_id] = token.replace(SPACE_MARK, " ").encode("utf-8")
            elif token not in self.special_tokens:
                if any(char not in byte_of for char in token):
                    raise ValueError(f"token {token_id} ({token!r}) is not spelled in GPT-2's byte alphabet")
                by_id[token_id] = bytes(byte_of[char] for char in token)
        for token, token_id in self.special_tokens.items():
            if self.vocab.get(token, token_id) != token_id:
                raise ValueError(
                    f"special token {token!r} has id {token_id}, but {self.vocab[token]} in the vocabulary"
                )
            if token not in self.vocab and token_id in by_id:
                raise ValueError(f"special token {token!r} has id {token_id}, already a token of the vocabulary")
            by_id[token_id] = token.encode("utf-8")
        if len(set(self.vocab.values())) != len(self.vocab):
            raise ValueError("the vocabulary gives the same id to two tokens")
        gaps = sorted(set(range(len(by_id))) - set(by_id))
        if gaps:
            raise ValueError(f"token ids must run from 0 without a gap; id {gaps[0]} is missing")
        return [by_id[i] for i in range(len(by_id))]

    @property
    def vocab_size(self) -> int:
        return len(self._id_bytes)

    def encode(self, text: str | bytes, allowed_special: str | set[str] | frozenset[str] = frozenset()) -> TokenIds:
        """The token ids of `text` (a str, or UTF-8 bytes: an invalid byte raises ValueError naming its offset).

        `allowed_special` is the special tokens to recognise in the text ("all" for every one); the others are
        encoded as the ordinary characters they are made of. No beginning-of-text token is added."""
        text = checked_text(text)
        if isinstance(allowed_special, str) and allowed_special != "all":
            raise ValueError(f"allowed_special is 'all' or a set of special tokens, got the string {allowed_special!r}")
        allowed = frozenset(self.special_tokens) if allowed_special == "all" else frozenset(allowed_special)
        if unknown := sorted(allowed - set(self.special_tokens)):
            raise ValueError(f"allowed_special names {unknown[:5]!r}, which are not special tokens of this tokenizer")
        ids: list[int] = []
        for index, (piece, is_special) in enumerate(split_special(text, allowed)):
            if is_special:
                ids.append(self.special_tokens[piece])
            else:
                for word in self._words(piece, at_start=index == 0):
                    ids.extend(self._word_ids(word))
        return np.array(ids, dtype=np.int64)

    def _words(self, piece: str, at_start: bool = True) -> list[str]:
        """The words of a piece of text between special tokens (`at_start`: the first, at the start of the
        text), spelled as the vocabulary spells them."""
        if self.style == "sentencepiece":  # Hugging Face's Prepend("▁") and Replace(" ", "▁") normalizers
            return [SPACE_MARK + piece.replace(" ", SPACE_MARK)]
        if self.style == "metaspace":
            prepend = self.prepend_scheme == "always" or (self.prepend_scheme == "first" and at_start)
            return self._metaspace_words(piece, prepend)
        alphabet = bytes_to_unicode()
        return ["".join(alphabet[byte] for byte in word.encode("utf-8")) for word in split_words(piece, self.style)]

    def _metaspace_words(self, piece: str, prepend: bool) -> list[str]:
        text = piece.replace(" ", SPACE_MARK)
        if prepend and text and not text.startswith(SPACE_MARK):
            text = SPACE_MARK + text
        return MARKED_WORDS.findall(text) if self.split else [text] if text else []

    def continuation_ids(self, text: str) -> list[int]:
        """The ids of a piece that continues a longer text (`bpe_bulk`): its words as `encode` spells them, but
        in the `▁` styles without the `▁` put in front of a text's start."""
        if self.style == "sentencepiece":
            words = [text.replace(" ", SPACE_MARK)]
        else:
            words = self._metaspace_words(text, False) if self.style == "metaspace" else self._words(text)
        return [i for word in words for i in self._word_ids(word)]

    def word_ids(self, word: str) -> tuple[int, ...]:
        """The ids of one word as the vocabulary spells it (after the split into words and, in "sentencepiece"
        style, the `▁` spaces): its merges, or the word whole with `ignore_merges`. `encode` calls it per word."""
        return self._word_ids(word)

    def _word_ids(self, word: str) -> tuple[int, ...]:
        if word not in self._cache:
            if len(self._cache) >= CACHED_WORDS:  # a corpus of millions of distinct words: start afresh
                self._cache.clear()
            if self.ignore_merges and word in self.vocab:
                self._cache[word] = (self.vocab[word],)
            else:
                self._cache[word] = tuple(self.vocab[token] for token in merge_word(self._symbols(word), self._ranks))
        return self._cache[word]

    def _symbols(self, word: str) -> list[str]:
        """The word's characters as tokens of the vocabulary, before any merge: byte tokens or the unknown
        token stand for a character the vocabulary lacks, when the tokenizer has them."""
        symbols: list[str] = []
        for char in word:
            if char in self.vocab:
                symbols.append(char)
            elif self.byte_fallback and all(f"<0x{b:02X}>" in self.vocab for b in char.encode("utf-8")):
                symbols.extend(f"<0x{b:02X}>" for b in char.encode("utf-8"))
            elif self.unk_token is not None:
                if not (self.fuse_unk and symbols and symbols[-1] == self.unk_token):
                    symbols.append(self.unk_token)
            else:
                raise ValueError(
                    f"character {char!r} (U+{ord(char):04X}) in the word {word!r} has no token, "
                    "and the tokenizer has no byte fallback or unknown token"
                )
        return symbols

    def decode(self, ids: ArrayLike) -> str:
        """The text of a 1-D sequence of ids. Bytes that do not form whole characters (a sample cut in the middle
        of one) become U+FFFD. In "sentencepiece" style the `▁` put in front of the text is taken off again."""
        ids = as_ids(ids, self.vocab_size)
        text = b"".join(self._id_bytes[i] for i in ids.tolist()).decode("utf-8", errors="replace")
        stripped = self.style == "sentencepiece" or (self.style == "metaspace" and self.prepend_scheme != "never")
        if stripped and text.startswith(" "):  # Hugging Face's Strip(" ", 1, 0) decoder, or Metaspace's
            text = text[1:]
        return text

    @classmethod
    def from_json(cls, data: dict, source: str = "tokenizer.json") -> "BPETokenizer":
        """The tokenizer of a Hugging Face tokenizer.json (parsed); anything it cannot do exactly is refused."""
        return cls(**bpe_files.read_tokenizer_json(data, source))

    @classmethod
    def from_gpt2_files(cls, vocab_path: str | Path, merges_path: str | Path) -> "BPETokenizer":
        """The tokenizer of GPT-2's `vocab.json` and `merges.txt` (`<|endoftext|>` becomes its special token)."""
        return cls(**bpe_files.read_gpt2_files(vocab_path, merges_path))

    def to_json(self) -> dict:
        """This tokenizer in Hugging Face's tokenizer.json layout, which `tokenizers.Tokenizer.from_file` loads."""
        return bpe_files.write_tokenizer_json(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")), str(path))
