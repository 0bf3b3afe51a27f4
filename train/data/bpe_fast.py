"""Who encodes a corpus's pieces: tiktoken or Hugging Face `tokenizers` when they give `BPETokenizer.encode`'s
ids, else the readable encoder.

Both are optional extras (`pip install tiktoken` or `tokenizers`), never run-time dependencies, and both are given
the texts of one piece at once, so they run on every core. "auto", the default, takes tiktoken when it is installed
and its rule is proven to give this BPE's ids (`bpe_tiktoken.py`: one merge per token, in rising order, as in
GPT-2's files and the BPEs `train_bpe` made in the tests and benchmarks); Hugging Face's BPE follows BPE's own rule
but ran at a third to a half of tiktoken's speed here (docs/benchmarks.md, "Encoding a corpus"), so it runs when asked.
"""

import importlib.util
import json
from collections.abc import Callable

import numpy as np

from train.data.bpe import BPETokenizer
from train.data.bpe_files import MARKED_SPACES
from train.data.bpe_tiktoken import NotExact, tiktoken_encoder
from train.data.tokenizers import Tokenizer

ENCODERS = ("auto", "tiktoken", "tokenizers", "readable")
TextsEncoder = Callable[[list[str]], np.ndarray]  # the ids of consecutive texts of one piece, joined


def hugging_face_encoder(tokenizer: BPETokenizer) -> TextsEncoder:
    """`encode_batch` of Hugging Face's tokenizer built from `tokenizer`'s tokenizer.json, special-token strings
    read as text. ImportError without `tokenizers`; ValueError for a `▁`-style tokenizer, whose every text
    Hugging Face would start with a `▁`, so that it cannot encode one in pieces."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("the tokenizers encoder needs Hugging Face tokenizers: pip install tokenizers") from None
    if tokenizer.style in MARKED_SPACES:
        raise ValueError(
            f"Hugging Face `tokenizers` cannot encode a {tokenizer.style!r}-style text in pieces (it puts a `▁` "
            "in front of every text it is given); use the readable encoder"
        )
    hugging_face = tokenizers.Tokenizer.from_str(json.dumps(tokenizer.to_json()))
    hugging_face.encode_special_tokens = True

    def encode(texts: list[str]) -> np.ndarray:
        ids = [np.asarray(e.ids, np.int64) for e in hugging_face.encode_batch(texts, add_special_tokens=False)]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)

    return encode


def fast_encoder(tokenizer: Tokenizer, encoder: str = "auto") -> tuple[str, TextsEncoder | None]:
    """(what encodes `tokenizer`'s pieces, in words; its function, or None for the readable encoder), for
    `encoder` one of ENCODERS. "auto" says why it fell back to the readable encoder; "tiktoken" and
    "tokenizers" raise instead: ImportError when not installed, ValueError (bpe_tiktoken.NotExact for
    tiktoken) when they cannot give this tokenizer's ids."""
    if encoder not in ENCODERS:
        raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
    if encoder == "readable":
        return "the readable encoder", None
    if not isinstance(tokenizer, BPETokenizer):
        if encoder == "auto":
            return "the readable encoder", None
        raise ValueError(f"{encoder} encodes a byte-level BPE, not a {tokenizer.kind!r} tokenizer")
    if encoder == "tokenizers":
        return "Hugging Face tokenizers", hugging_face_encoder(tokenizer)
    if encoder == "tiktoken" or importlib.util.find_spec("tiktoken") is not None:
        try:
            return "tiktoken (exact for this BPE)", tiktoken_encoder(tokenizer)
        except NotExact as e:
            if encoder == "tiktoken":
                raise
            return f"the readable encoder (tiktoken would not be exact: {e})", None
    return "the readable encoder (tiktoken is not installed)", None
