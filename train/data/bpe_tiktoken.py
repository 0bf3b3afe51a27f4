"""tiktoken as an exact encoder of a byte-level BPE: when its rule gives BPE's ids, and a proof of it.

tiktoken merges a word's bytes by a different rule than BPE's (`bpe.merge_word`): it merges the adjacent pair
whose *concatenation* has the lowest rank, and it takes a word that is itself a token whole. BPE merges the
adjacent pair *listed in the merges* that was learned first. Both take the leftmost of equal candidates. The
two differ on a vocabulary where a token can also be assembled from another pair than the merge that made it:
with the merges (b, c), (a, b), (ab, c), BPE makes `a bc` of "abc" (bc first, and (a, bc) is no merge),
tiktoken makes `abc`.

They agree on every word when tiktoken is given, ranked by the order the merges were learned, only the tokens
that BPE makes of their own bytes (each byte, and each merge's token `t` with `merge_word(t) == [t]`: call
them whole), provided each token is made by one merge and each merge uses bytes or tokens of earlier merges.
Why:

1. Within a word BPE's merges come in rising rank: a new pair holds the token just made, and a merge that uses
   a token was learned after it (checked: a file may list its merges in another order).
2. A stretch of the word between two places where no merge has happened yet evolves as BPE on that stretch
   alone would, up to then (a merge never reaches across the places).
3. Say both rules have reached the same pieces, and the lowest-ranked merge among the adjacent pairs has rank
   r. tiktoken's candidates are those pairs plus the pairs (x, y) whose join t is a whole token but not by its
   merge. If rank(t) <= r: the stretch x y evolved as BPE on t's bytes alone, which makes [t] through merges of
   rank <= rank(t) (t is whole); the stretch is not [t] yet, so its next merge, of rank < r (or t's own merge,
   which would be (x, y) itself), is among the adjacent pairs: against r being the lowest. So tiktoken merges
   what BPE merges; a token that is not whole is one BPE never makes (by 2, the stretch it covers would be BPE
   of its own bytes), so leaving it out of the ranks changes nothing.
4. A word that is itself a whole token is one token by both rules. With `ignore_merges` (Llama 3) BPE takes any
   token whole, so there every token must be whole, and no special token may be a word.

`tiktoken_ranks` checks those conditions on the vocabulary (one merge per token, merges in rising order, every
byte a token, and with `ignore_merges` every token whole and no special token a word), and `tiktoken_encoder`
builds the encoder, or says which condition failed. A vocabulary converted from tiktoken's by Hugging Face
(`TikTokenConverter`, Llama 3's tokenizer.json) lists every split of a token as a merge, so it is refused and
encoded by the readable encoder. The words are cut by the same pattern in both (GPT-2's, Llama 3's), with the
character classes of each library's Unicode tables: a character that Python's `unicodedata` does not know yet
(assigned in a later Unicode version) may be classed differently. tests/train/data/test_bpe_tiktoken.py checks
the ids on every word of small random vocabularies and on a sample of every plane's code points.
"""

import os
from collections.abc import Callable

import numpy as np

from train.data.bpe import BPETokenizer, merge_word
from train.data.bpe_split import PATTERNS, bytes_to_unicode, split_words


class NotExact(ValueError):
    """tiktoken's rule would not give this tokenizer's BPE ids on every text; the message says why."""


def made_tokens(tokenizer: BPETokenizer) -> list[str]:
    """The tokens `tokenizer`'s merges make, in merge order. NotExact when two merges make one token, or a merge
    uses a token that only a later merge makes (BPE's ranks would not rise within a word)."""
    made: dict[str, int] = {}
    alphabet = set(bytes_to_unicode().values())
    for rank, (left, right) in enumerate(tokenizer.merges):
        token = left + right
        if token in made:
            raise NotExact(f"the token {token!r} is made by two merges, {made[token]} and {rank}")
        if late := [part for part in (left, right) if part not in alphabet and part not in made]:
            raise NotExact(f"merge {rank} ({left!r}, {right!r}) uses {late[0]!r} before a merge makes it")
        made[token] = rank
    return list(made)


def whole_tokens(tokenizer: BPETokenizer) -> list[str]:
    """The tokens of `tokenizer`'s merges, in merge order, that BPE makes of their own bytes."""
    return [token for token in made_tokens(tokenizer) if merge_word(list(token), tokenizer._ranks) == [token]]


def tiktoken_ranks(tokenizer: BPETokenizer) -> tuple[dict[bytes, int], np.ndarray]:
    """(tiktoken's `mergeable_ranks`: each byte and each whole token, ranked in merge order; the id of each
    rank). NotExact when the tokenizer is not byte-level, a byte has no token, the merges are not one per token
    in rising order, or with `ignore_merges` a word could be taken whole by BPE and not by tiktoken."""
    if tokenizer.style not in PATTERNS:
        raise NotExact(f"a {tokenizer.style!r}-style tokenizer is not byte-level")
    alphabet = bytes_to_unicode()
    byte_of = {char: byte for byte, char in alphabet.items()}
    if missing := [byte for byte, char in alphabet.items() if char not in tokenizer.vocab]:
        raise NotExact(f"the byte {missing[0]:#04x} has no token")
    whole = whole_tokens(tokenizer)
    if tokenizer.ignore_merges:
        ordinary = set(tokenizer.vocab) - set(tokenizer.special_tokens) - set(alphabet.values())
        if not_whole := sorted(ordinary - set(whole)):
            raise NotExact(f"with ignore_merges every token must be whole, but BPE splits {not_whole[0]!r}")
        if (word := _special_word(tokenizer)) is not None:
            raise NotExact(f"with ignore_merges the special token {word!r} is also a word, which BPE takes whole")
    tokens = list(alphabet.values()) + whole
    ranks = {bytes(byte_of[char] for char in token): rank for rank, token in enumerate(tokens)}
    return ranks, np.array([tokenizer.vocab[token] for token in tokens], np.int64)


def _special_word(tokenizer: BPETokenizer) -> str | None:
    """A special token of the vocabulary whose spelling is also the spelling of a word of text, or None."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    for token in tokenizer.special_tokens:
        if token in tokenizer.vocab and all(char in byte_of for char in token):
            text = bytes(byte_of[char] for char in token).decode("utf-8", "replace")
            if split_words(text, tokenizer.style) == [text]:
                return token
    return None


def tiktoken_encoder(tokenizer: BPETokenizer, threads: int | None = None) -> Callable[[list[str]], np.ndarray]:
    """The ids of a list of texts (consecutive pieces of one text, each ending where a word ends), joined, by
    tiktoken on `threads` threads (default: the cores): `tokenizer.encode`'s, special-token strings read as
    text. ImportError without tiktoken; NotExact when its rule could differ (see the module)."""
    try:
        import tiktoken
    except ImportError:
        raise ImportError("the tiktoken encoder needs tiktoken: pip install tiktoken") from None
    ranks, ids = tiktoken_ranks(tokenizer)
    encoding = tiktoken.Encoding(
        f"purejax-{tokenizer.style}", pat_str=PATTERNS[tokenizer.style], mergeable_ranks=ranks, special_tokens={}
    )
    threads = threads or os.cpu_count() or 1

    def encode(texts: list[str]) -> np.ndarray:
        ranked = encoding.encode_ordinary_batch(texts, num_threads=threads)
        return ids[np.concatenate([np.asarray(r, np.int64) for r in ranked])] if ranked else ids[:0]

    return encode
