"""train.data.bpe_train and `python -m train.data --tokenizer bpe`: the same merges as Hugging Face's BpeTrainer
(ties included), a corpus small enough to check by hand, and a prepared dataset that decodes back exactly."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.train.data.conftest import HOSTILE
from train.data import open_dataset
from train.data.__main__ import main as cli
from train.data.bpe import BPETokenizer
from train.data.bpe_train import train_bpe
from train.data.dataset import fingerprint


def test_merges_by_hand():
    """Words "low", " lower", " lowest": (l, o) and (o, w) both occur 3 times; the smaller pair of ids wins
    (l < o < w in the alphabet's code-point order). Then (Ġ, low) and (low, e) tie at 2: Ġ is a byte token,
    id below 256, and "low" is id 257, so (Ġ, low) comes first."""
    tokenizer = train_bpe("low lower lowest", 260, special_tokens=())
    assert tokenizer.merges == (("l", "o"), ("lo", "w"), ("Ġ", "low"), ("Ġlow", "e"))
    assert tokenizer.vocab["low"] == 257 and tokenizer.vocab_size == 260
    assert [tokenizer.decode([i]) for i in tokenizer.encode(" lowest low")] == [" lowe", "s", "t", " low"]


def test_merges_equal_hugging_face_bpe_trainer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = "\n".join(HOSTILE * 3) + Path(__file__).read_text()
    reference = tokenizers.Tokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    reference.train_from_iterator([text], trainer)
    data = json.loads(reference.to_str())
    ours = train_bpe(text, 900)
    assert ours.merges == tuple(tuple(pair) for pair in data["model"]["merges"])
    assert ours.vocab == data["model"]["vocab"] and ours == BPETokenizer.from_json(data)
    reference.encode_special_tokens = True  # "<|endoftext|>" in the text is text
    for sample in HOSTILE:
        assert ours.encode(sample).tolist() == reference.encode(sample).ids


def test_trainer_errors_and_an_exhausted_text():
    with pytest.raises(ValueError, match="vocab_size 200 is below the 257 special and byte tokens"):
        train_bpe("abc", 200)
    assert train_bpe("abab", 1000).vocab_size == 259  # <|endoftext|>, 256 bytes, "ab", "abab": no pair left


def test_prepare_a_bpe_dataset_from_the_command_line(tmp_path, capsys):
    text = "It's a small corpus: the cat sat on the mat, and the dog's toy isn't here. Привет! 123456\n" * 30
    (tmp_path / "t.txt").write_text(text)
    out = tmp_path / "out"
    meta = cli(["--input", str(tmp_path / "t.txt"), "--tokenizer", "bpe", "--vocab_size", "300", "--out_dir", str(out)])
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 300
    data = open_dataset(out)
    assert isinstance(data.tokenizer, BPETokenizer) and data.train.dtype == np.uint16
    assert data.tokenizer.decode(np.concatenate([data.train, data.val])) == text
    assert meta["tokens"] < len(text) / 2  # merges make tokens longer than one byte
    assert fingerprint(data)["tokenizer"]["kind"] == "bpe"
    for argv, message in [
        (["--tokenizer", "bpe"], "--vocab_size goes with --tokenizer bpe"),
        (["--vocab_size", "300"], "--vocab_size goes with --tokenizer bpe"),
    ]:
        with pytest.raises(SystemExit) as exit:
            cli(["--input", str(tmp_path / "t.txt"), "--out_dir", str(out), *argv])
        assert exit.value.code == 2 and message in capsys.readouterr().err
