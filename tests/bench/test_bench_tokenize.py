"""bench/tokenize.py: every contender encodes the text to the readable encoder's ids (the "same ids" column
its table reports), and the tiktoken peer, given the BPE's tokens as ranks, reads the same pattern."""

import importlib.util
import inspect
import textwrap

from bench import tokenize
from train.data import train_bpe

TEXT = inspect.getsource(textwrap) * 2


def test_every_contender_gives_the_readable_ids():
    data = train_bpe(TEXT, 400).to_json()
    results = tokenize.measure(tokenize.contenders(data, workers=2), TEXT, repeats=1)
    assert {"readable", "bulk, 2 processes"} <= set(results)
    if importlib.util.find_spec("tokenizers"):  # the test extra has it
        assert {"bulk, tokenizers", "tokenizers, one call"} <= set(results)
    if importlib.util.find_spec("tiktoken"):  # so has this one
        assert {"bulk, tiktoken", "tiktoken, batch"} <= set(results)
    assert all(same for _, same in results.values()), results
    assert all(seconds > 0 for seconds, _ in results.values())
