"""Model surgery on a GPT (models/gpt.py): the same weights, a shorter context or a smaller vocabulary.

nanoGPT crops GPT-2's 1024 learned positions to fine-tune at a shorter block_size; the padding rows of a
vocabulary (GPT-2's 50257 padded to 50304, or the rows tensor parallelism adds so the table splits evenly)
are dropped before sampling, so that no id the tokenizer cannot decode is ever drawn. Both return new params
and a new config, and leave every logit the kept positions and tokens had unchanged (tests/models).
"""

import dataclasses

from models.gpt import GPTConfig, Params


def crop_block_size(params: Params, config: GPTConfig, block_size: int) -> tuple[Params, GPTConfig]:
    """A model with a shorter context: the first `block_size` learned positions are kept (nanoGPT's model
    surgery, e.g. to fine-tune GPT-2's 1024-token model at 256). Returns new params and config."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= config.block_size:
        raise ValueError(
            f"crop_block_size: block_size must be an int in [1, {config.block_size}] (the current block_size), "
            f"got {block_size!r}; a model cannot be extended to positions it never learned"
        )
    params = {**params, "wpe": {**params["wpe"], "w": params["wpe"]["w"][:block_size]}}
    return params, dataclasses.replace(config, block_size=block_size)


def crop_vocab(params: Params, config: GPTConfig, vocab_size: int) -> tuple[Params, GPTConfig]:
    """A model over only the first `vocab_size` token ids: the rest of the embedding table is dropped, so the
    tied head never produces, and sampling never picks, an id the tokenizer cannot decode. The real tokens'
    logits are unchanged. Returns new params and config."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= config.vocab_size:
        raise ValueError(
            f"crop_vocab: vocab_size must be an int in [1, {config.vocab_size}] (the current vocab_size), "
            f"got {vocab_size!r}"
        )
    params = {**params, "wte": {**params["wte"], "w": params["wte"]["w"][:vocab_size]}}
    return params, dataclasses.replace(config, vocab_size=vocab_size)
