"""train.data.bpe_tiktoken: tiktoken, given the whole tokens ranked by merge order, gives `BPETokenizer.encode`'s
ids: on every word of small random vocabularies (tokens that are not whole included, the case where
tiktoken's own rule differs), on hostile text, and on a sample of every plane's code points; what it cannot
promise is refused by name."""

import numpy as np
import pytest

from tests.train.data.conftest import HOSTILE
from train.data import bpe_bulk
from train.data.bpe import BPETokenizer
from train.data.bpe_split import bytes_to_unicode
from train.data.bpe_tiktoken import NotExact, tiktoken_encoder, tiktoken_ranks, whole_tokens

tiktoken = pytest.importorskip("tiktoken")  # the test extra has it


def byte_level(merges: list[tuple[str, str]], extra: tuple[str, ...] = (), **options) -> BPETokenizer:
    """A GPT-2-style tokenizer: the 256 byte tokens (ids in GPT-2's byte order), each merge's token, then the
    `extra` tokens that no merge makes."""
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for token in [left + right for left, right in merges] + list(extra):
        vocab.setdefault(token, len(vocab))
    return BPETokenizer(vocab, tuple(merges), **options)


def test_a_token_assembled_from_another_pair_is_left_out():
    """(b, c), (a, b), (ab, c): BPE makes `a bc` of "abc"; tiktoken's own rule, every token ranked, makes
    `abc`. Left out of the ranks (BPE never makes it: it is not whole), tiktoken gives BPE's ids."""
    tokenizer = byte_level([("b", "c"), ("a", "b"), ("ab", "c")])
    assert tokenizer.encode("abc").tolist() == [tokenizer.vocab["a"], tokenizer.vocab["bc"]]
    assert naive_tiktoken(tokenizer)("abc").tolist() == [tokenizer.vocab["abc"]]  # tiktoken's rule, not BPE's
    assert whole_tokens(tokenizer) == ["bc", "ab"]
    assert tiktoken_encoder(tokenizer)(["abc", " abcabc"]).tolist() == tokenizer.encode("abc abcabc").tolist()
    with pytest.raises(NotExact, match="with ignore_merges every token must be whole, but BPE splits 'abc'"):
        tiktoken_ranks(byte_level([("b", "c"), ("a", "b"), ("ab", "c")], ignore_merges=True))


def test_every_word_of_random_vocabularies_encodes_as_bpe_does():
    """Random merges over "abcd" (tokens whole or not), every word of up to 6 letters, each after a space (a
    byte no merge uses): the same ids as `encode`, where tiktoken's own rule (every merge's token ranked)
    differs for about half of the vocabularies. The proof in bpe_tiktoken.py, checked exhaustively on small
    cases."""
    words = [word for n in range(1, 7) for word in _words("abcd", n)]
    text = "".join(" " + word for word in words)
    naive_differs = 0
    for seed in range(20):
        tokenizer = random_vocabulary(seed)
        want = tokenizer.encode(text)
        np.testing.assert_array_equal(tiktoken_encoder(tokenizer, threads=1)([text]), want, err_msg=f"seed {seed}")
        naive_differs += not np.array_equal(naive_tiktoken(tokenizer)(text), want)
    assert naive_differs >= 5


def random_vocabulary(seed: int) -> BPETokenizer:
    """12 random merges of tokens over "abcd", each making a new token of at most 5 letters."""
    rng = np.random.default_rng(seed)
    tokens, merges = ["a", "b", "c", "d"], []
    while len(merges) < 12:
        left, right = (tokens[i] for i in rng.integers(0, len(tokens), 2))
        if left + right not in tokens and len(left + right) <= 5:
            merges.append((left, right))
            tokens.append(left + right)
    return byte_level(merges)


def naive_tiktoken(tokenizer: BPETokenizer):
    """encode(text) by tiktoken's own rule over every token of `tokenizer`'s merges (the ids as `tokenizer`'s)."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in tokenizer.vocab.items()}
    encoding = tiktoken.Encoding("naive", pat_str=r" ?\w+|\W+", mergeable_ranks=ranks, special_tokens={})
    return lambda text: np.asarray(encoding.encode_ordinary(text))


def _words(letters: str, n: int) -> list[str]:
    """Every word of `n` of `letters`."""
    words = [""]
    for _ in range(n):
        words = [word + letter for word in words for letter in letters]
    return words


def test_what_tiktoken_cannot_promise_is_refused_by_name():
    """One merge per token, merges in rising order (the proof's step 1), every byte a token, and with
    ignore_merges every token whole and no special token a word."""
    with pytest.raises(NotExact, match="the token 'abc' is made by two merges, 2 and 3"):
        whole_tokens(byte_level([("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]))
    with pytest.raises(NotExact, match=r"merge 0 \('aa', 'a'\) uses 'aa' before a merge makes it"):
        tiktoken_ranks(byte_level([("aa", "a"), ("a", "a")]))
    with pytest.raises(NotExact, match="with ignore_merges every token must be whole, but BPE splits 'xyz'"):
        tiktoken_ranks(byte_level([("a", "b")], ignore_merges=True, extra=["xyz"]))
    with pytest.raises(NotExact, match="with ignore_merges the special token 'cd' is also a word"):
        tiktoken_ranks(byte_level([("c", "d")], ignore_merges=True, special_tokens={"cd": 256}))
    vocab = {char: i for i, char in enumerate(list(bytes_to_unicode().values())[1:])}
    with pytest.raises(NotExact, match="the byte 0x21 has no token"):
        tiktoken_ranks(BPETokenizer(vocab, ()))


@pytest.mark.parametrize("style", ["hf_gpt2", "hf_llama3"])
def test_hostile_text_and_a_sample_of_every_code_point(request, style):
    """The Hugging Face-trained GPT-2 and Llama 3 style tokenizers (every token whole): the same ids as `encode`
    on the hostile texts, whole and in pieces, and on every 29th code point of every plane in words of letters
    and digits, where the two libraries' character classes decide the words."""
    tokenizer = BPETokenizer.from_json(request.getfixturevalue(style)[1])
    encode = tiktoken_encoder(tokenizer)
    text = "\n".join(HOSTILE) + "<|endoftext|><s>"  # special-token strings are text here
    want = tokenizer.encode(text)
    np.testing.assert_array_equal(encode([text]), want)
    np.testing.assert_array_equal(encode(bpe_bulk.pieces(tokenizer, text, size=40)), want)
    chars = [chr(c) for c in range(0, 0x110000, 29) if not 0xD800 <= c < 0xE000]
    probe = "".join(f"a{c}1 {c}{c}\n" for c in chars)
    np.testing.assert_array_equal(encode([probe]), tokenizer.encode(probe))
