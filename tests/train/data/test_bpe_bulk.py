"""train.data.bpe_bulk: a corpus cut into pieces at newlines between two non-space characters, encoded piece by
piece (by tiktoken or Hugging Face `tokenizers` for a byte-level BPE, or by the readable encoder in several
processes), gives exactly the ids of `BPETokenizer.encode` on the whole text, in each of the three styles, on
hostile text."""

import numpy as np
import pytest

from tests.train.data.conftest import HOSTILE
from train.data import bpe_bulk
from train.data.bpe import BPETokenizer

SEPARATORS = ["\n", " \n", "\n\n", "\r\n", "x\ny", ".\n", "\n ", " ", "\t\n\t", "'s\n's", "12\n34"]


def corpus(seed: int, n: int = 200) -> str:
    """Hostile texts joined by separators chosen to sit at (or beside) the places where a corpus may be cut."""
    rng = np.random.default_rng(seed)
    return "".join(HOSTILE[i] + SEPARATORS[j] for i, j in zip(rng.integers(0, len(HOSTILE), n), rng.integers(0, 11, n)))


@pytest.fixture(params=["hf_gpt2", "hf_llama3", "hf_sentencepiece", "hf_sentencepiece_by_words"])
def tokenizer(request) -> BPETokenizer:
    return BPETokenizer.from_json(request.getfixturevalue(request.param)[1])


def test_pieces_cut_only_between_words_and_join_back(tokenizer):
    for seed in range(5):
        text = corpus(seed)
        parts = bpe_bulk.pieces(tokenizer, text, size=40)
        assert "".join(parts) == text
        if bpe_bulk.cut_pattern(tokenizer) is None:
            assert parts == [text]  # a merge joins a symbol to one starting with `▁`: never cut
            continue
        assert len(parts) > 20
        joined = np.concatenate(list(bpe_bulk.encode_pieces(tokenizer, parts)))
        np.testing.assert_array_equal(joined, tokenizer.encode(text))


@pytest.mark.parametrize("encoder", ["tiktoken", "tokenizers"])
def test_the_fast_encoders_give_the_readable_encoders_ids(tokenizer, encoder, monkeypatch):
    """tiktoken and Hugging Face `tokenizers` encode a byte-level BPE's pieces, each cut again (here into
    texts of about 20 characters); a `▁`-style tokenizer is refused by name."""
    pytest.importorskip(encoder)
    monkeypatch.setattr(bpe_bulk, "FAST_PIECE_CHARS", 20)
    text = corpus(7)
    if tokenizer.style in ("gpt2", "llama3"):
        got = bpe_bulk.encode_corpus(tokenizer, text, encoder=encoder, piece_chars=200)
        np.testing.assert_array_equal(got, tokenizer.encode(text))
    else:
        with pytest.raises(ValueError, match=f"{tokenizer.style}'-style"):
            bpe_bulk.encode_corpus(tokenizer, text, encoder=encoder)


def test_the_default_and_several_processes_give_the_readable_encoders_ids(tokenizer):
    """ "auto" (tiktoken where installed and exact, the readable encoder for the `▁` styles) and the readable
    encoder over two processes; bytes that are not UTF-8 named by their offset."""
    text = corpus(7)
    want = tokenizer.encode(text)
    np.testing.assert_array_equal(bpe_bulk.encode_corpus(tokenizer, text.encode(), piece_chars=50), want)
    if tokenizer.style == "gpt2":  # the process pool once (it starts two interpreters)
        got = bpe_bulk.encode_corpus(tokenizer, text, workers=2, encoder="readable", piece_chars=500)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="not valid UTF-8 at byte offset 3"):
        bpe_bulk.encode_corpus(tokenizer, b"abc\xff")


def test_a_sentencepiece_text_is_cut_only_when_no_merge_crosses_a_space(request):
    """Merges learned across `▁` (hf_sentencepiece) leave the text whole; merges learned on words
    (hf_sentencepiece_by_words, as SentencePiece trains) let it be cut before spaces, the later pieces encoded
    without the `▁` in front, to the ids of the whole text, in this process and over two."""
    across = BPETokenizer.from_json(request.getfixturevalue("hf_sentencepiece")[1])
    by_words = BPETokenizer.from_json(request.getfixturevalue("hf_sentencepiece_by_words")[1])
    text = corpus(3)
    assert bpe_bulk.pieces(across, text, size=40) == [text]
    parts = bpe_bulk.pieces(by_words, text, size=40)
    assert len(parts) > 20 and "".join(parts) == text and all(part.startswith(" ") for part in parts[1:])
    want = by_words.encode(text)
    np.testing.assert_array_equal(bpe_bulk.encode_corpus(by_words, text, piece_chars=40), want)
    np.testing.assert_array_equal(bpe_bulk.encode_corpus(by_words, text, workers=2, piece_chars=2000), want)


def test_a_metaspace_text_is_cut_before_spaces_when_it_splits_into_words(hf_metaspace):
    """Split into words at `▁`, no merge crosses one, so the text is cut before spaces; unsplit, as the
    SentencePiece style, only when no merge crosses. The ids are the whole text's either way."""
    tokenizer = BPETokenizer.from_json(hf_metaspace[1])
    text = corpus(5)
    parts = bpe_bulk.pieces(tokenizer, text, size=40)
    assert "".join(parts) == text
    assert len(parts) > 20 if tokenizer.split else bpe_bulk.cut_pattern(tokenizer) is None or len(parts) > 20
    want = tokenizer.encode(text)
    np.testing.assert_array_equal(np.concatenate(list(bpe_bulk.encode_pieces(tokenizer, parts))), want)
    np.testing.assert_array_equal(bpe_bulk.encode_corpus(tokenizer, text, piece_chars=40), want)
