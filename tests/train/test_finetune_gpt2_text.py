"""Fine-tuning an imported GPT-2 on a text file with the model's own tokenizer, end to end: `train.gpt
--init_from=<Hugging Face directory> --dataset=<text file>` tokenizes the text with the directory's BPE, trains,
saves the tokenizer in out_dir, and `train.sample` decodes a text prompt with it. A tiny GPT-2 directory and a
BPE trained on the text stand in for the downloaded ones."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from models import gpt, gpt_hf
from train import data as data_lib
from train import gpt as gpt_program
from train import sample as sample_program

TINY = ["--config=gpt_tiny", "--progress=false", "--peak_flops=1e11"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """~20 KB of English: the standard library's pydoc topics."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "notes.txt"
    path.write_text("\n".join(topics[k] for k in sorted(topics))[:20_000])
    return path


def gpt2_directory(path: Path, tokenizer: data_lib.Tokenizer | None, vocab_size: int) -> Path:
    """A tiny GPT-2 in Hugging Face's layout (config.json, model.safetensors), with `tokenizer` as tokenizer.json."""
    config = gpt.GPTConfig(block_size=32, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, bias=True, gelu="tanh")
    gpt_hf.save(gpt.init(jax.random.key(0), config), config, path)
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")
    return path


def test_gpt2_fine_tunes_on_text_with_its_own_tokenizer_and_samples_text(tmp_path, text_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = text_file.read_text()
    tokenizer = data_lib.train_bpe(text, vocab_size=320)
    model = gpt2_directory(tmp_path / "gpt2", tokenizer, tokenizer.vocab_size)
    run = [*TINY, f"--dataset={text_file}", f"--init_from={model}", "--out_dir=ft", "--eval_interval=15"]
    gpt_program.main([*run, "--max_iters=30", "--lr_decay_iters=30", "--learning_rate=3e-3"])

    evaluations = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["val_loss"] for row in evaluations if "val_loss" in row]
    assert losses[-1] < losses[0] - 0.5, losses  # from about ln(320) = 5.8
    assert data_lib.load_tokenizer(tmp_path / "ft" / "tokenizer.json") == tokenizer
    (prepared,) = (tmp_path / "data" / "cache").glob("notes-bpe-*")
    dataset = data_lib.open_dataset(prepared)
    np.testing.assert_array_equal(np.concatenate([dataset.train, dataset.val]), tokenizer.encode(text))

    samples = sample_program.main(["--out_dir=ft", "--start=The class ", "--num_samples=2", "--max_new_tokens=8"])
    assert len(samples) == 2 and all(sample.startswith("The class ") for sample in samples)
    assert all(len(sample) > len("The class ") for sample in samples)

    # A resume tokenizes the text with the tokenizer saved in out_dir: the same data, so the fingerprint agrees.
    assert gpt_program.main(["--out_dir=ft", "--init_from=resume", "--eval_only=true"])["iter"] == 30

    # Another model's tokenizer: the prepared directory is refused, the text itself is prepared anew.
    other_tokenizer = data_lib.train_bpe(text, vocab_size=300)
    other = gpt2_directory(tmp_path / "other", other_tokenizer, other_tokenizer.vocab_size)
    with pytest.raises(SystemExit, match="prepared with another tokenizer .*bpe, 320 tokens.*bpe, 300 tokens"):
        gpt_program.main([*TINY, f"--dataset={prepared}", f"--init_from={other}", "--out_dir=other"])
    assert data_lib.ensure_dataset(text_file, tokenizer=other_tokenizer, log=None).resolve() != prepared
    assert data_lib.ensure_dataset(text_file, tokenizer=tokenizer, log=None).resolve() == prepared


def test_a_directory_without_a_tokenizer_is_refused_when_the_vocabulary_sizes_differ(tmp_path, text_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    characters = len(set(text_file.read_text()))
    model = gpt2_directory(tmp_path / "gpt2", None, vocab_size=characters + 10)
    with pytest.raises(
        SystemExit, match=f"char tokenizer has {characters} tokens where the model has {characters + 10}"
    ):
        gpt_program.main([*TINY, f"--dataset={text_file}", f"--init_from={model}", "--out_dir=ft"])
