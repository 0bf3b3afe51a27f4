"""models.gpt_surgery: a cropped model computes what the whole one computed on what it kept (against the
float64 numpy GPT of test_gpt.py), and impossible crops are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt_surgery
from tests.models.test_gpt import CONFIG, B, apply, make_params, numpy_forward, tokens


def test_crop_block_size_keeps_the_first_positions():
    params, idx = make_params(), tokens((B, 5))
    cropped, config = gpt_surgery.crop_block_size(params, CONFIG, 5)
    assert config.block_size == 5 and cropped["wpe"]["w"].shape == (5, CONFIG.n_embd)
    logits = apply(cropped, idx.astype(jnp.uint16), config)  # token files are often uint16
    np.testing.assert_allclose(logits, numpy_forward(params, idx, CONFIG), rtol=1e-4, atol=1e-4)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 8\]"):
            gpt_surgery.crop_block_size(params, CONFIG, bad)


def test_crop_vocab_keeps_the_real_tokens_logits_and_drops_the_padding():
    params, idx = make_params(), tokens((B, 5))
    real = CONFIG.vocab_size - 3  # as if the last 3 ids were padding no tokenizer decodes
    cropped, config = gpt_surgery.crop_vocab(params, CONFIG, real)
    assert config.vocab_size == real and cropped["wte"]["w"].shape == (real, CONFIG.n_embd)
    logits = apply(cropped, idx % real, config)
    np.testing.assert_allclose(logits, apply(params, idx % real, CONFIG)[..., :real], rtol=1e-5, atol=1e-5)
    for bad in (0, CONFIG.vocab_size + 1, True):
        with pytest.raises(ValueError, match=rf"vocab_size must be an int in \[1, {CONFIG.vocab_size}\]"):
            gpt_surgery.crop_vocab(params, CONFIG, bad)
