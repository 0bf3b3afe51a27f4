"""bench/prepare.py: the corpus is built to the size asked, and every contender (train.data's command line with a
given tokenizer.json, by tiktoken and by the readable encoder, and nanoGPT's way with tiktoken, when the bench
extra is installed) writes the same ids."""

import importlib.util
import sys

import pytest

from bench import prepare


def test_the_corpus_has_the_size_asked(tmp_path):
    distinct = prepare.build_corpus(tmp_path / "corpus.txt", 2)
    assert (tmp_path / "corpus.txt").stat().st_size >= 2_000_000 and distinct > 0
    (tmp_path / "corpus.txt").read_text(encoding="utf-8")  # UTF-8 throughout


@pytest.mark.skipif(not importlib.util.find_spec("tiktoken"), reason="tiktoken is in the bench extra")
def test_every_contender_writes_the_same_ids(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.prepare", "--size_mb", "1", "--vocab_size", "300"])
    prepare.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| t")]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), rows
