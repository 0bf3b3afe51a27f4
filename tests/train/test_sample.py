"""train.sample on a checkpoint whose vocabulary is padded beyond its tokenizer's (as tensor parallelism pads
it): the padding ids must never be sampled, however likely the model makes them. And what it cannot sample
from is a one-line error; a damaged newest checkpoint is skipped for the newest readable one."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from models import gpt
from purejax import checkpoint
from train import sample
from train.data.tokenizers import CharTokenizer, save_tokenizer


def test_a_padded_vocabulary_is_never_sampled(tmp_path):
    tokenizer = CharTokenizer(tuple("abcde"))
    config = gpt.GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=2, n_embd=16)  # ids 5..7: padding
    params = gpt.init(jax.random.key(0), config)
    # Make the padding rows dominate every logit: uncropped, sampling would pick them nearly always.
    params["wte"]["w"] = params["wte"]["w"].at[5:].set(100.0 * jnp.sign(params["wte"]["w"][:1]))
    assert int(jnp.argmax(gpt.apply(params, jnp.zeros((1, 1), jnp.int32), config)[0, -1])) >= 5
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    checkpoint.CheckpointManager(tmp_path).save(1, {"params": params}, config={"model": dataclasses.asdict(config)})
    texts = sample.main(
        [f"--out_dir={tmp_path}", "--start=a", "--num_samples=3", "--max_new_tokens=20", "--temperature=2.0"]
    )
    assert len(texts) == 3 and all(len(t) == 21 and set(t) <= set("abcde") for t in texts)


def tiny_run(tmp_path, tree=None, config=True, steps=(1,)):
    """An out_dir with a tokenizer and checkpoints of a 1-layer GPT (or of `tree`) at `steps`."""
    model = gpt.GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=16)
    save_tokenizer(CharTokenizer(tuple("abcde")), tmp_path / "tokenizer.json")
    manager = checkpoint.CheckpointManager(tmp_path)
    for step in steps:
        manager.save(
            step,
            tree or {"params": gpt.init(jax.random.key(step), model)},
            config={"model": dataclasses.asdict(model)} if config else None,
        )
    return manager


@pytest.mark.parametrize(
    "tree, config, args, message",
    [
        (None, True, ["--step=999"], "no checkpoint for step 999 in"),
        ({"weights": {"w": jnp.zeros(3)}}, True, [], "ckpt_00000001.msgpack holds no 'params': not a train.gpt"),
        (None, False, [], "ckpt_00000001.msgpack has no GPT config"),
        (None, True, ["--top_k=0"], "top_k=0: must be >= 1"),
    ],
)
def test_what_cannot_be_sampled_is_a_one_line_error(tmp_path, tree, config, args, message):
    tiny_run(tmp_path, tree, config)
    with pytest.raises(SystemExit) as e:
        sample.main([f"--out_dir={tmp_path}", "--max_new_tokens=2", *args])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_readable(tmp_path, capsys):
    manager = tiny_run(tmp_path, steps=(1, 2))
    data = bytearray(manager.path(2).read_bytes())
    data[-5] ^= 0xFF  # an array byte: the header still reads, the checksum does not match
    manager.path(2).write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="skipping an unreadable checkpoint"):
        texts = sample.main([f"--out_dir={tmp_path}", "--start=a", "--num_samples=1", "--max_new_tokens=3"])
    assert len(texts) == 1 and "checkpoint 1;" in capsys.readouterr().err
