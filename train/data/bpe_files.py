"""BPE tokenizers on disk: GPT-2's `vocab.json` + `merges.txt`, and Hugging Face's `tokenizer.json`.

A tokenizer.json names the pieces of Hugging Face's pipeline (normalizer, pre_tokenizer, model, decoder) with
their settings. Four combinations are read, each the one a known model ships (see `bpe.py` for what they do):

| style | normalizer | pre_tokenizer | model |
|---|---|---|---|
| "gpt2" | null | ByteLevel (use_regex, no prefix space) | BPE |
| "llama3" | null | Sequence[Split(Llama 3's pattern, Isolated), ByteLevel (no regex)] | BPE, ignore_merges |
| "sentencepiece" | Sequence[Prepend("▁"), Replace(" ", "▁")] | null | BPE, byte_fallback, `<unk>` |
| "metaspace" | null | Metaspace("▁", prepend_scheme, split) | BPE, byte_fallback, `<unk>` |

Anything else (a WordPiece or Unigram model, another pre-tokenizer, dropout, a prefix space, an added
token that strips spaces...) is refused with an error naming the field and its value: a tokenizer that
encodes a little differently from the one a model was trained with is worse than none. The post_processor
(which adds `<s>` or `<|begin_of_text|>` in front) is not applied: `encode` gives the ids of the text alone.
These functions work on plain values (the fields of `bpe.BPETokenizer`), so this file needs no tokenizer class.
"""

import json
from pathlib import Path

from train.data.bpe_split import LLAMA3_PATTERN, PATTERNS

SPACE_MARK = "▁"
MARKED_SPACES = ("sentencepiece", "metaspace")  # the styles whose spaces are `▁` (SentencePiece's)
PREPEND_SCHEMES = ("always", "first", "never")  # Metaspace's: a `▁` before every section of text, the first, none
BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
SENTENCEPIECE_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": SPACE_MARK},
        {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK},
    ],
}
SENTENCEPIECE_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _refuse(source: str, field: str, value, expected: str) -> ValueError:
    return ValueError(f"{source}: {field} is {json.dumps(value)[:200]}; only {expected} is implemented")


def _byte_level(pre_tokenizer: dict, use_regex: bool, source: str, field: str) -> None:
    """Check a ByteLevel pre-tokenizer: no prefix space, and the GPT-2 regex used (`use_regex`) or not."""
    if pre_tokenizer.get("add_prefix_space", False):
        raise _refuse(source, f"{field}.add_prefix_space", True, "false")
    if pre_tokenizer.get("use_regex", True) != use_regex:
        raise _refuse(source, f"{field}.use_regex", pre_tokenizer.get("use_regex", True), json.dumps(use_regex))


def _metaspace(pre_tokenizer: dict, source: str) -> dict:
    """The settings of a Metaspace pre-tokenizer: `prepend_scheme` and `split` (an older file's
    `add_prefix_space` is the "always" or "never" scheme, and it always split)."""
    if pre_tokenizer.get("replacement", SPACE_MARK) != SPACE_MARK:
        raise _refuse(source, "pre_tokenizer.replacement", pre_tokenizer["replacement"], json.dumps(SPACE_MARK))
    legacy = "always" if pre_tokenizer.get("add_prefix_space", True) else "never"
    scheme = pre_tokenizer.get("prepend_scheme", legacy)
    if scheme not in PREPEND_SCHEMES:
        raise _refuse(source, "pre_tokenizer.prepend_scheme", scheme, " or ".join(map(json.dumps, PREPEND_SCHEMES)))
    return {"prepend_scheme": scheme, "split": bool(pre_tokenizer.get("split", True))}


def _words_style(data: dict, source: str) -> str:
    """Which of the four styles the normalizer and pre_tokenizer of `data` describe."""
    normalizer, pre_tokenizer = data.get("normalizer"), data.get("pre_tokenizer")
    if normalizer is not None:
        if normalizer != SENTENCEPIECE_NORMALIZER:
            raise _refuse(source, "normalizer", normalizer, "null or Sequence[Prepend('▁'), Replace(' ', '▁')]")
        if pre_tokenizer is not None:
            raise _refuse(source, "pre_tokenizer", pre_tokenizer, "null with that normalizer")
        return "sentencepiece"
    kind = pre_tokenizer.get("type") if isinstance(pre_tokenizer, dict) else pre_tokenizer
    if kind == "Metaspace":
        return "metaspace"
    if kind == "ByteLevel":
        _byte_level(pre_tokenizer, True, source, "pre_tokenizer")
        return "gpt2"
    parts = pre_tokenizer.get("pretokenizers", []) if kind == "Sequence" else []
    if [part.get("type") for part in parts] != ["Split", "ByteLevel"]:
        raise _refuse(source, "pre_tokenizer", pre_tokenizer, "ByteLevel, Metaspace, or Sequence[Split, ByteLevel]")
    split = parts[0]
    pattern = split.get("pattern", {}).get("Regex")
    names = [name for name, known in PATTERNS.items() if known == pattern]
    if not names:
        raise _refuse(source, "pre_tokenizer.pretokenizers[0].pattern", split.get("pattern"), "GPT-2's or Llama 3's")
    for key, value in (("behavior", "Isolated"), ("invert", False)):
        if split.get(key) != value:
            raise _refuse(source, f"pre_tokenizer.pretokenizers[0].{key}", split.get(key), json.dumps(value))
    _byte_level(parts[1], False, source, "pre_tokenizer.pretokenizers[1]")
    return names[0]


def _check_decoder(decoder, style: str, source: str) -> None:
    expected = SENTENCEPIECE_DECODER if style in MARKED_SPACES else BYTE_LEVEL_DECODER
    if decoder is None or decoder.get("type") == expected["type"] == "ByteLevel":
        return
    if style == "metaspace" and decoder.get("type") == "Metaspace":
        return
    if style in MARKED_SPACES:
        types = [part.get("type") for part in decoder.get("decoders", [])]
        if decoder == expected or (decoder.get("type") == "Sequence" and types == ["Replace", "Fuse", "Strip"]):
            return
    raise _refuse(source, "decoder", decoder, f"null or {json.dumps(expected, ensure_ascii=False)}")


def _merge_pair(item, rank: int, source: str) -> tuple[str, str]:
    """A merge as written in a file: `"a b"` (merges.txt, older tokenizer.json) or `["a", "b"]`."""
    pair = item.split(" ") if isinstance(item, str) else item
    if not isinstance(pair, list | tuple) or len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
        raise ValueError(f"{source}: merge {rank} is {item!r}, not two tokens")
    return pair[0], pair[1]


def _special_tokens(data: dict, style: str, source: str) -> dict[str, int]:
    """The added tokens, each checked to be special, matched as it is (no stripping), to its id."""
    specials = {}
    for token in data.get("added_tokens") or []:
        where = f"{source}: added token {token.get('id')} ({token.get('content')!r})"
        for flag in ("lstrip", "rstrip", "single_word"):
            if token.get(flag):
                raise ValueError(f"{where} has {flag}=true; only added tokens matched exactly are implemented")
        if not token.get("special"):
            raise ValueError(f"{where} has special=false; only special added tokens are implemented")
        if token.get("normalized") and style in MARKED_SPACES:
            raise ValueError(f"{where} has normalized=true; matching after the normalizer is not implemented")
        specials[token["content"]] = token["id"]
    return specials


def read_tokenizer_json(data: dict, source: str = "tokenizer.json") -> dict:
    """The `bpe.BPETokenizer` fields of a parsed Hugging Face tokenizer.json, or ValueError naming what is not
    implemented (the field and its value)."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise ValueError(f"{source}: no 'model' object; not a Hugging Face tokenizer.json")
    if model.get("type", "BPE") != "BPE":
        raise _refuse(source, "model.type", model.get("type"), '"BPE"')
    for field in ("truncation", "padding"):
        if data.get(field) is not None:
            raise _refuse(source, field, data[field], "null")
    for field in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(field):
            raise _refuse(source, f"model.{field}", model[field], "null")
    style = _words_style(data, source)
    _check_decoder(data.get("decoder"), style, source)
    spaces = _metaspace(data["pre_tokenizer"], source) if style == "metaspace" else {}
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        raise ValueError(f"{source}: model.vocab must be an object and model.merges a list")
    return {
        "vocab": model["vocab"],
        "merges": tuple(_merge_pair(item, rank, source) for rank, item in enumerate(model["merges"])),
        "special_tokens": _special_tokens(data, style, source),
        "style": style,
        "ignore_merges": bool(model.get("ignore_merges", False)),
        "unk_token": model.get("unk_token"),
        "byte_fallback": bool(model.get("byte_fallback", False)),
        "fuse_unk": bool(model.get("fuse_unk", False)),
        **spaces,
    }


def read_gpt2_files(vocab_path: str | Path, merges_path: str | Path) -> dict:
    """The `bpe.BPETokenizer` fields of GPT-2's `vocab.json` (token to id) and `merges.txt` (one merge a line,
    after a `#version` line); `<|endoftext|>`, if in the vocabulary, is the special token."""
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    if not isinstance(vocab, dict):
        raise ValueError(f"{vocab_path}: a vocab.json is an object from token to id")
    lines = Path(merges_path).read_text(encoding="utf-8").split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = tuple(_merge_pair(line, rank, str(merges_path)) for rank, line in enumerate(lines) if line)
    specials = {"<|endoftext|>": vocab["<|endoftext|>"]} if "<|endoftext|>" in vocab else {}
    return {"vocab": vocab, "merges": merges, "special_tokens": specials, "style": "gpt2"}


def _pre_tokenizer(tokenizer) -> dict | None:
    style = tokenizer.style
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": style == "gpt2"}
    if style == "metaspace":
        return {"type": "Metaspace", "replacement": SPACE_MARK} | _spaces(tokenizer)
    if style == "gpt2":
        return byte_level
    if style == "llama3":
        split = {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False}
        return {"type": "Sequence", "pretokenizers": [split, byte_level]}
    return None


def _spaces(tokenizer) -> dict:
    return {"prepend_scheme": tokenizer.prepend_scheme, "split": tokenizer.split}


def _decoder(tokenizer) -> dict:
    if tokenizer.style == "metaspace":
        return {"type": "Metaspace", "replacement": SPACE_MARK} | _spaces(tokenizer)
    return SENTENCEPIECE_DECODER if tokenizer.style == "sentencepiece" else BYTE_LEVEL_DECODER


def write_tokenizer_json(tokenizer) -> dict:
    """A Hugging Face tokenizer.json (as a dict) for the fields of `tokenizer` (a `bpe.BPETokenizer`)."""
    sentencepiece = tokenizer.style == "sentencepiece"
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": True}
        for s, i in sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": SENTENCEPIECE_NORMALIZER if sentencepiece else None,
        "pre_tokenizer": _pre_tokenizer(tokenizer),
        "post_processor": None,
        "decoder": _decoder(tokenizer),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokenizer.unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": tokenizer.fuse_unk,
            "byte_fallback": tokenizer.byte_fallback,
            "ignore_merges": tokenizer.ignore_merges,
            "vocab": dict(tokenizer.vocab),
            "merges": [list(pair) for pair in tokenizer.merges],
        },
    }
