"""train.data.prepare streams a corpus: files read a chunk at a time (a character cut between two reads kept
whole), cut into pieces, encoded over processes and appended to the token file. Checked against the whole
text tokenized at once, and for memory against the corpus's size."""

import hashlib
import importlib
import json
import tracemalloc

import numpy as np
import pytest

from tests.train.data.conftest import HOSTILE
from train.data import bpe_bulk, corpus
from train.data.corpus import SEPARATOR, Source, read_source
from train.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer

prepare = importlib.import_module("train.data.prepare")  # the module: train.data.prepare is also the function


@pytest.fixture
def small_reads(monkeypatch):
    """Chunks of 7 bytes and pieces of 50 characters, so a small corpus crosses many of both."""
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 7)
    monkeypatch.setattr(prepare, "PIECE_CHARS", 50)


def write_corpus(directory, n_files: int = 4) -> str:
    """Files of hostile text (every script, emoji, combining marks), one empty; returns the joined text."""
    texts = ["\n".join(HOSTILE[i::n_files]) for i in range(n_files)] + [""]
    directory.mkdir()
    for i, text in enumerate(texts):
        (directory / f"{i}.txt").write_text(text, encoding="utf-8")
    return SEPARATOR.join(text for text in texts if text)


def test_a_chunk_stream_cuts_into_the_pieces_of_the_whole_text():
    text = "".join(HOSTILE) * 3
    for where in (bpe_bulk.WORD_CUT, bpe_bulk.cut_pattern(ByteTokenizer()), None):
        whole = list(bpe_bulk.cut([text], where, size=30))
        streamed = list(bpe_bulk.cut((text[i : i + 11] for i in range(0, len(text), 11)), where, size=30))
        assert streamed == whole and "".join(streamed) == text


def test_files_read_in_chunks_are_the_text_and_name_a_bad_byte(tmp_path, small_reads):
    text = write_corpus(tmp_path / "corpus")
    source = read_source(tmp_path / "corpus")
    assert source.read_text() == text and source.size_bytes() == len(text.encode())
    assert sum(size for _, size in source.chunks()) == len(text.encode())
    bad = tmp_path / "bad.txt"
    bad.write_bytes("héllo wörld".encode() + b"\xff rest")
    with pytest.raises(ValueError, match=r"bad.txt is not UTF-8 text \(byte 13: b'\\xff"):
        read_source(bad).read_text()
    bad.write_bytes("ends mid-character: é".encode()[:-1])
    with pytest.raises(ValueError, match=r"bad.txt is not UTF-8 text \(byte 20: b'\\xc3'\)"):
        read_source(bad).read_text()


@pytest.mark.parametrize(
    "kind, vocab_size, workers, encoder",
    [("char", None, 1, "auto"), ("byte", None, 1, "auto"), ("bpe", 300, 2, "readable"), ("bpe", 300, 1, "auto")],
)
def test_a_streamed_corpus_prepares_as_the_whole_text_does(tmp_path, small_reads, kind, vocab_size, workers, encoder):
    """The ids, the tokenizer and meta.json's text fields equal those of the whole text in memory, tokenized
    by one `encode` call; a BPE trained on the stream's pieces is the one trained on the whole text. A BPE's
    pieces are encoded by the readable encoder over two processes, and by tiktoken where it is installed
    ("auto")."""
    text = write_corpus(tmp_path / "corpus")
    source = read_source(tmp_path / "corpus")
    meta = prepare.prepare(source, tmp_path / "out", kind, vocab_size, workers=workers, encoder=encoder)
    whole = prepare.prepare(Source(text, "in memory", ["all"]), tmp_path / "whole", kind, vocab_size)
    tokenizer = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert tokenizer.to_json() == load_tokenizer(tmp_path / "whole" / "tokenizer.json").to_json()
    dtype = prepare.DTYPES[meta["dtype"]]
    ids = np.concatenate([np.fromfile(tmp_path / "out" / name, dtype) for name in ("train.bin", "val.bin")])
    np.testing.assert_array_equal(ids, tokenizer.encode(text))
    assert len(np.fromfile(tmp_path / "out" / "train.bin", dtype)) == meta["train_tokens"] == len(ids) * 9 // 10
    assert meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest() == whole["text_sha256"]
    assert (meta["text_chars"], meta["text_bytes"]) == (len(text), len(text.encode()))
    assert {k: v for k, v in meta.items() if k not in ("source", "files")} == {
        k: v for k, v in whole.items() if k not in ("source", "files")
    }
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(prepare.FILES)  # no token file left


def test_memory_holds_a_few_pieces_not_the_corpus(tmp_path, monkeypatch):
    """An 8 MiB file prepared in 256 KiB reads and pieces: the peak of Python's allocations stays below the
    corpus's own size."""
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 1 << 18)
    monkeypatch.setattr(prepare, "PIECE_CHARS", 1 << 18)
    rng = np.random.default_rng(0)
    path = tmp_path / "big.txt"
    path.write_bytes(rng.integers(ord(" "), ord("~") + 1, size=8 << 20, dtype=np.uint8).tobytes())
    tracemalloc.start()
    try:
        meta = prepare.prepare(read_source(path), tmp_path / "out", "byte")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta["tokens"] == 8 << 20
    # the whole text alone would be 8 MiB, its ids as int64 64 MiB; a few pieces' worth is about 6 MiB
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB for an 8 MiB corpus"


def test_an_empty_corpus_and_a_failed_encoding_leave_no_token_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="the input is empty"):
        prepare.prepare(read_source(tmp_path / "empty.txt"), tmp_path / "out")
    given = CharTokenizer.from_text("ab")
    with pytest.raises(ValueError, match="'c'"):
        prepare.prepare(Source("abc", "in memory", ["abc"]), tmp_path / "out", given)
    assert list((tmp_path / "out").iterdir()) == []
