"""The configurations bench/gpt_train.py times and the contenders it can time: each case's model, batch and
sampling, the peers' names, and the one batch every contender of a case is fed.

    cases(["tiny", "baby"], bias="both")     # {"tiny": Case, "tiny-bias": Case, "baby": ..., "baby-bias": ...}
    x, y = case_batch(CASES["baby"])         # numpy int32 (batch, block_size) inputs and targets
"""

import dataclasses

import numpy as np

from models import gpt


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark configuration: the model, the batch size, and how long to sample."""

    model: gpt.GPTConfig
    batch: int
    repeats: int  # default number of interleaved samples
    sample_seconds: float | None  # per sample; None: one step per sample


def case_model(n_layer, n_head, n_embd, block_size, vocab_size=65) -> gpt.GPTConfig:
    """A case's model: nanoGPT's bias=False, `layers` left at GPTConfig's default (the `purejax` contender's)."""
    return gpt.GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=0.0,
        bias=False,
    )


SMALL = case_model(6, 6, 384, 256)  # shakespeare-char's shape (nanoGPT's config/train_shakespeare_char.py)
CASES = {
    "tiny": Case(case_model(2, 2, 32, 32), batch=8, repeats=9, sample_seconds=0.1),  # dispatch-bound
    "baby": Case(case_model(4, 4, 128, 64), batch=12, repeats=7, sample_seconds=0.25),  # nanoGPT's CPU config
    "small": Case(SMALL, batch=4, repeats=3, sample_seconds=None),
    "small-b16": Case(SMALL, batch=16, repeats=3, sample_seconds=None),
    # GPT-2 124M (GPT-2's vocabulary padded to 50304, nanoGPT's; no biases): for a GPU
    "gpt2": Case(case_model(12, 12, 768, 1024, vocab_size=50304), batch=16, repeats=5, sample_seconds=1.0),
}
PEERS = (
    "purejax",
    "purejax-scan",
    "purejax-loop",
    "raw",
    "raw-scan",
    "nnx",
    "nnx-tree",
    "nnx-split",
    "equinox",
    "haiku",
    "torch",
    "torch-compile",
)
DEFAULT_PEERS = tuple(p for p in PEERS if p != "raw-scan")  # raw-scan on request: it keeps the run shorter
BIAS_SUFFIX = "-bias"


def cases(configs: list[str], bias: str) -> dict[str, Case]:
    """The runs `--configs` and `--bias` ask for, by label: each config without biases ("tiny"), with GPT-2's
    biases ("tiny-bias"), or both in that order."""
    if bias not in ("false", "true", "both"):
        raise ValueError(f"bias must be false, true or both, got {bias!r}")
    out = {}
    for name in configs:
        if bias != "true":
            out[name] = CASES[name]
        if bias != "false":
            case = CASES[name]
            out[name + BIAS_SUFFIX] = dataclasses.replace(case, model=dataclasses.replace(case.model, bias=True))
    return out


def case_batch(case):
    """The case's one batch (inputs, targets), tokens uniform over the vocabulary from a fixed rng."""
    config = case.model
    data = np.random.default_rng(0).integers(0, config.vocab_size, (case.batch, config.block_size + 1), np.int32)
    return data[:, :-1], data[:, 1:]
