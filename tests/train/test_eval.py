"""train.eval on a GPT trained for a few steps by train.gpt, and on a tiny Llama in Hugging Face's layout: the
loss and perplexity against a direct computation here (for each scored token, the model's float64
log-probability given exactly the context the sliding-window recipe gives it, from `apply` on that window),
for disjoint windows, overlapping ones and a text shorter than one window; and every input it refuses."""

import ast
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from models import gpt, llama, llama_hf
from train import eval as eval_program
from train import gpt as gpt_program
from train.data import load_tokenizer
from train.data.tokenizers import CharTokenizer, save_tokenizer
from train.kit.trained import load_model

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16  # the tiny GPT's context
TINY = ["--config=gpt_tiny", "--progress=false", f"--block_size={BLOCK}", "--eval_iters=1", "--compile_cache=off"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A train.gpt out_dir: gpt_tiny, trained for 3 steps on some of the standard library's pydoc topics."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("eval")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(topics[k] for k in sorted(topics))[:20_000])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # the prepared corpus goes to ./data
        gpt_program.main([*TINY, f"--dataset={corpus}", "--out_dir=out", "--max_iters=3", "--eval_interval=1000"])
    return root / "out"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_loss(apply, ids: np.ndarray, context: int, stride: int) -> float:
    """The mean -log p(ids[t] | its context) over t = 1 .. n-1, where token t is scored by the first window
    (inputs ids[k*stride : k*stride + context]) that predicts it: k = max(0, ceil((t - context) / stride))."""
    n = len(ids)
    by_window: dict[int, list[int]] = {}
    for t in range(1, n):
        by_window.setdefault(max(0, math.ceil((t - context) / stride)), []).append(t)
    total = 0.0
    for k, targets in by_window.items():
        begin = k * stride
        window = ids[begin : max(targets)]  # the explicit window: every token before the last one it scores
        log_probs = log_softmax(np.asarray(apply(window[None, :]))[0])
        total -= sum(log_probs[t - 1 - begin, ids[t]] for t in targets)
    return total / (n - 1)


@pytest.mark.parametrize(("characters", "stride"), [(100, BLOCK), (100, 5), (11, BLOCK)])
def test_loss_and_perplexity_match_a_direct_computation(run, tmp_path, characters, stride):
    text = "def score(window):\n    return sum(token for token in window) / len(window)\n" * 2
    (tmp_path / "text.txt").write_text(text[:characters])
    args = [f"--model={run}", f"--text={tmp_path / 'text.txt'}", "--batch_size=3"]
    result = eval_program.main([*args, *([f"--stride={stride}"] if stride != BLOCK else [])])
    params, config, _ = load_model(run)
    ids = load_tokenizer(run / "tokenizer.json").encode(text[:characters])
    expected = reference_loss(lambda idx: gpt.apply(params, idx, config), ids, BLOCK, stride)
    assert result["tokens"] == characters - 1
    np.testing.assert_allclose(result["loss"], expected, rtol=2e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)


def test_two_devices_split_the_windows_and_agree_with_one(run, tmp_path):
    """In a fresh process with 2 simulated CPU devices (XLA reads the flag once, at start): each batch's rows
    split over them, the same loss as on one device here."""
    (tmp_path / "text.txt").write_text("def score(window):\n    return len(window)\n" * 3)
    args = [f"--model={run}", f"--text={tmp_path / 'text.txt'}", "--stride=6", "--batch_size=3"]
    code = f"import jax; from train import eval; assert jax.local_device_count() == 2; print(eval.main({args!r}))"
    two_devices = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    flags = {"XLA_FLAGS": two_devices, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **flags}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    two_devices = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    one_device = eval_program.main(args)
    assert two_devices["tokens"] == one_device["tokens"]
    np.testing.assert_allclose(two_devices["loss"], one_device["loss"], rtol=1e-6)


def test_a_checkpoint_file_and_a_step_give_the_same_model(run, tmp_path):
    (tmp_path / "text.txt").write_text("return window\n" * 3)
    text = f"--text={tmp_path / 'text.txt'}"
    by_dir = eval_program.main([f"--model={run}", text, "--step=3"])
    by_file = eval_program.main([f"--model={run / 'ckpt_00000003.msgpack'}", text])
    assert by_dir == by_file


def tiny_llama(directory):
    """A 2-layer Llama written in Hugging Face's layout with models/llama_hf.py's export."""
    config = llama.LlamaConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=12)
    params = llama.init(jax.random.key(1), config)
    llama_hf.save(params, config, directory)
    return params, config


def test_a_hugging_face_llama_is_evaluated_on_token_ids(tmp_path):
    params, config = tiny_llama(tmp_path / "llama")
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=40)
    np.save(tmp_path / "ids.npy", ids)
    ids.astype("<u2").tofile(tmp_path / "val.bin")  # a prepared dataset's token file
    args = [f"--model={tmp_path / 'llama'}", "--stride=7", "--batch_size=2"]
    result = eval_program.main([*args, f"--ids={tmp_path / 'ids.npy'}"])
    expected = reference_loss(lambda idx: llama.apply(params, idx, config), ids, config.max_seq_len, 7)
    np.testing.assert_allclose(result["loss"], expected, rtol=2e-6)
    assert eval_program.main([*args, f"--ids={tmp_path / 'val.bin'}"]) == result
    # No tokenizer the program can read: the error names the file and the way out.
    (tmp_path / "llama" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(SystemExit, match=r"cannot read the tokenizer .*llama/tokenizer.json .*--ids"):
        eval_program.main([f"--model={tmp_path / 'llama'}", f"--text={tmp_path / 'text.txt'}"])


def tiny_out_dir(directory, vocab: str, vocab_size: int):
    """An out_dir by hand: a 1-layer GPT of `vocab_size` ids and a char tokenizer of `vocab`."""
    from purejax import checkpoint

    config = gpt.GPTConfig(block_size=8, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16)
    save_tokenizer(CharTokenizer(tuple(vocab)), directory / "tokenizer.json")
    manager = checkpoint.CheckpointManager(directory)
    manager.save(1, {"params": gpt.init(jax.random.key(0), config)}, config={"model": dataclasses.asdict(config)})


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (b"ab\xffcd", [], r"is not UTF-8 text: byte 0xff at byte offset 2"),
        (b"abz", [], r"cannot be encoded with .*'z'"),
        (b"a", [], r"is 1 token\(s\) long; a perplexity needs at least 2"),
        (b"abcab", ["--stride=9"], r"stride=9 must be between 1 and the context length 8"),
        (b"abcab", ["--context=9"], r"context=9 exceeds the model's context length 8"),
        (b"abcab", ["--ids=x.npy"], r"one of --text=<file> or --ids=<file>"),
        (b"abcab", ["--step=2"], r"no checkpoint for step 2"),
    ],
)
def test_what_cannot_be_scored_is_a_one_line_error(tmp_path, content, args, message):
    tiny_out_dir(tmp_path, "abcde", 5)
    (tmp_path / "text.txt").write_bytes(content)
    with pytest.raises(SystemExit, match=message) as e:
        eval_program.main([f"--model={tmp_path}", f"--text={tmp_path / 'text.txt'}", *args])
    assert "\n" not in str(e.value)


def test_ids_outside_the_vocabulary_and_a_tokenizer_too_large_are_refused(tmp_path):
    tiny_out_dir(tmp_path, "abcdefg", 5)  # 7 characters, 5 embedding rows
    (tmp_path / "text.txt").write_text("abc")
    with pytest.raises(SystemExit, match=r"has 7 tokens, more than the 5 rows of the model's embedding"):
        eval_program.main([f"--model={tmp_path}", f"--text={tmp_path / 'text.txt'}"])
    np.save(tmp_path / "ids.npy", np.array([0, 1, 4, 5, 2, 9]))
    with pytest.raises(SystemExit, match=r"token id 5 at position 3 is outside the model's vocabulary \[0, 5\)"):
        eval_program.main([f"--model={tmp_path}", f"--ids={tmp_path / 'ids.npy'}"])
