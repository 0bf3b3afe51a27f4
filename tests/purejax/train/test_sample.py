"""train.sample on a checkpoint whose vocabulary is padded beyond its tokenizer's (as tensor parallelism pads
it): the padding ids must never be sampled, however likely the model makes them."""

import dataclasses

import jax
import jax.numpy as jnp

from purejax.models import gpt
from purejax import checkpoint
from purejax.train import sample
from purejax.train.data.tokenizers import CharTokenizer, save_tokenizer


def test_a_padded_vocabulary_is_never_sampled(tmp_path):
    tokenizer = CharTokenizer(tuple("abcde"))
    config = gpt.GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=2, n_embd=16)  # ids 5..7: padding
    params = gpt.init(jax.random.key(0), config)
    # Make the padding rows dominate every logit: uncropped, sampling would pick them nearly always.
    params["wte"]["w"] = params["wte"]["w"].at[5:].set(100.0 * jnp.sign(params["wte"]["w"][:1]))
    assert int(jnp.argmax(gpt.apply(params, jnp.zeros((1, 1), jnp.int32), config)[0, -1])) >= 5
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    checkpoint.CheckpointManager(tmp_path).save(1, {"params": params}, config={"model": dataclasses.asdict(config)})
    texts = sample.main([f"--out_dir={tmp_path}", "--start=a", "--num_samples=3", "--max_new_tokens=20",
                         "--temperature=2.0"])  # fmt: skip
    assert len(texts) == 3 and all(len(t) == 21 and set(t) <= set("abcde") for t in texts)
