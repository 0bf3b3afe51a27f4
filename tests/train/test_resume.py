"""`--init_from=resume` in every program refuses what it cannot continue, with one line naming the file and what
is wrong, before anything compiles: a checkpoint without settings, one written by another program, and (for
train.gpt) a dataset whose content differs from the one the checkpoint was trained on."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from purejax import checkpoint
from train import classify, flow, gpt
from train.data import Source, prepare
from train.kit import resume

TINY = ["--config=gpt_tiny", "--progress=false", "--peak_flops=1e11"]


@pytest.mark.parametrize("main", [gpt.main, flow.main, classify.main], ids=lambda m: m.__module__)
@pytest.mark.parametrize("config", [None, {"program": "train.other", "train": {}, "model": {}}], ids=["none", "other"])
def test_resume_refuses_a_checkpoint_it_did_not_write(tmp_path, main, config):
    checkpoint.CheckpointManager(tmp_path).save(3, {"params": {"w": jnp.zeros(2)}}, config=config)
    with pytest.raises(SystemExit) as e:
        main([f"--out_dir={tmp_path}", "--init_from=resume"])
    message = str(e.value)
    assert message.startswith(f"error: cannot resume from {tmp_path / 'ckpt_00000003.msgpack'}") and "\n" not in message
    assert ("lacks the ['train'" in message) if config is None else ("written by train.other, not train." in message)


def test_the_data_fingerprint_names_what_differs():
    saved = {"data": {"tokenizer": {"kind": "char", "vocab_size": 108}, "train.bin": {"bytes": 10, "crc32": "ab"}}}
    same = {"tokenizer": {"kind": "char", "vocab_size": 108}, "train.bin": {"bytes": 10, "crc32": "ab"}}
    assert resume.check_data(saved, same, "data/x") is None
    with pytest.raises(SystemExit) as e:
        resume.check_data(saved, {**same, "tokenizer": {"kind": "char", "vocab_size": 109}}, "data/x")
    assert (
        "tokenizer: the checkpoint was trained on kind char, vocab_size 108, data/x has kind char, vocab_size 109"
        in str(e.value)
    ) and "train.bin" not in str(e.value)
    resume.check_data(None, same, "data/x", say=pytest.fail)  # not resuming: nothing to check
    said = []
    resume.check_data({}, same, "data/x", say=said.append)
    assert len(said) == 1 and "records no fingerprint of its data, so data/x is not checked" in said[0]


def test_resume_on_a_dataset_prepared_again_from_other_text_is_refused(tmp_path, monkeypatch):
    """The issue's case: data/stdlib prepared by another Python (one more character, every later id shifted)."""
    monkeypatch.chdir(tmp_path)
    text = "".join(chr(c) for c in range(32, 127)) * 40
    prepare(Source(text, "text", ["a"]), tmp_path / "data" / "notes")
    gpt.main([*TINY, "--dataset=notes", "--out_dir=run", "--max_iters=2", "--eval_interval=1000"])
    saved_tokenizer = (tmp_path / "run" / "tokenizer.json").read_text()
    prepare(Source("\u00e9" + text, "text", ["a"]), tmp_path / "data" / "notes")  # é: vocabulary 95 -> 96
    with pytest.raises(SystemExit) as e:
        gpt.main(["--out_dir=run", "--init_from=resume", "--max_iters=4"])
    message = str(e.value)
    assert "dataset 'notes' (data/notes) is not the data the checkpoint was trained on" in message
    assert "vocab_size 95" in message and "vocab_size 96" in message and "train.bin: " in message
    assert (tmp_path / "run" / "tokenizer.json").read_text() == saved_tokenizer  # not overwritten
    info = checkpoint.read_metadata(tmp_path / "run" / "ckpt_00000002.msgpack")
    assert info.config["program"] == "train.gpt" and info.config["data"]["tokenizer"]["vocab_size"] == 95
    assert json.loads(saved_tokenizer)["vocab"] == sorted(set(text))


def test_array_fingerprint_changes_with_any_byte():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = a.copy()
    b[2, 3] = np.nextafter(b[2, 3], 100)
    assert resume.array_fingerprint(x=a) == resume.array_fingerprint(x=a.copy())
    assert resume.array_fingerprint(x=a) != resume.array_fingerprint(x=b)


def test_a_damaged_newest_checkpoint_is_not_silently_replaced_by_an_older_one(tmp_path):
    """The settings come from the newest checkpoint's header; the state must come from the same file. A newest
    file whose header reads but whose arrays fail their checksum is an error that says how to continue from the
    older one, never the older state under the newer settings."""
    manager = checkpoint.CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, {"w": jnp.full(64, float(step))}, config={"program": "p", "train": {}})
    newest = manager.path(2)
    data = bytearray(newest.read_bytes())
    data[-20] ^= 0xFF  # inside the array bytes, past the header
    newest.write_bytes(bytes(data))
    assert resume.saved_config(manager, "p")["program"] == "p"  # the header still reads
    with pytest.raises(SystemExit) as e:
        resume.restore(manager, lambda: {"w": jnp.zeros(64)})
    assert str(e.value).startswith(f"error: cannot resume from {tmp_path}") and "move ckpt_00000002.msgpack" in str(
        e.value
    )
