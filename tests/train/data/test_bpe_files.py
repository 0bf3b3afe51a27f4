"""train.data.bpe_files: GPT-2's vocab.json + merges.txt and Hugging Face's tokenizer.json, read and written; what is
not implemented refused by name. The foreign reader and writer is Hugging Face `tokenizers` itself."""

import copy
import json

import pytest

from tests.train.data.conftest import HOSTILE
from train.data.bpe import BPETokenizer
from train.data.tokenizers import load_tokenizer, save_tokenizer


def test_gpt2_vocab_and_merges_files(hf_gpt2, tmp_path):
    reference, data = hf_gpt2
    reference.model.save(str(tmp_path))  # vocab.json and merges.txt, as GPT-2 ships them
    ours = BPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert ours.special_tokens == {"<|endoftext|>": 0}
    assert (tmp_path / "merges.txt").read_text().startswith("#version")
    for text in HOSTILE:
        reference.encode_special_tokens = True
        assert ours.encode(text).tolist() == reference.encode(text).ids, repr(text)


@pytest.mark.parametrize("style", ["hf_gpt2", "hf_llama3", "hf_sentencepiece"])
def test_written_tokenizer_json_loads_in_hugging_face(style, request, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    ours = BPETokenizer.from_json(request.getfixturevalue(style)[1])
    save_tokenizer(ours, tmp_path / "tokenizer.json")
    theirs = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in HOSTILE:
        assert ours.encode(text, allowed_special="all").tolist() == theirs.encode(text).ids, repr(text)
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded == ours and loaded.kind == "bpe" and BPETokenizer.load(tmp_path / "tokenizer.json") == ours


def edited(data: dict, path: str, value) -> dict:
    """A deep copy of `data` with the value at the dotted `path` replaced (list items by index)."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    here = data
    for key in parents:
        here = here[int(key)] if isinstance(here, list) else here[key]
    here[int(last) if isinstance(here, list) else last] = value
    return data


REFUSED = [
    ("hf_gpt2", "model.type", "WordPiece", r"model.type is \"WordPiece\"; only \"BPE\""),
    ("hf_gpt2", "model.type", "Unigram", r"model.type is \"Unigram\""),
    ("hf_gpt2", "model.dropout", 0.1, r"model.dropout is 0.1"),
    ("hf_gpt2", "model.continuing_subword_prefix", "##", r"model.continuing_subword_prefix is \"##\""),
    ("hf_gpt2", "pre_tokenizer.add_prefix_space", True, r"pre_tokenizer.add_prefix_space is true"),
    ("hf_gpt2", "pre_tokenizer", {"type": "Whitespace"}, r"pre_tokenizer is \{\"type\": \"Whitespace\"\}"),
    (
        "hf_gpt2",
        "pre_tokenizer",
        {"type": "Whitespace"},
        r"pre_tokenizer is \{\"type\": \"Whitespace\"\}; only ByteLevel, Metaspace,",
    ),
    ("hf_gpt2", "normalizer", {"type": "Lowercase"}, r"normalizer is \{\"type\": \"Lowercase\"\}"),
    ("hf_gpt2", "decoder", {"type": "WordPiece"}, r"decoder is \{\"type\": \"WordPiece\"\}"),
    ("hf_gpt2", "truncation", {"max_length": 8}, r"truncation is \{\"max_length\": 8\}"),
    ("hf_gpt2", "added_tokens.0.lstrip", True, r"added token 0 \('<\|endoftext\|>'\) has lstrip=true"),
    ("hf_gpt2", "added_tokens.1.special", False, r"added token 1 \('<s>'\) has special=false"),
    ("hf_llama3", "pre_tokenizer.pretokenizers.0.pattern", {"Regex": r"\w+"}, r"pattern is \{\"Regex\": \"\\\\w\+\"\}"),
    ("hf_llama3", "pre_tokenizer.pretokenizers.0.behavior", "Removed", r"behavior is \"Removed\""),
    ("hf_llama3", "pre_tokenizer.pretokenizers.1.use_regex", True, r"pretokenizers\[1\].use_regex is true"),
    ("hf_sentencepiece", "normalizer.normalizers.0.prepend", "_", r"normalizer is .*only null or Sequence"),
    ("hf_sentencepiece", "added_tokens.1.normalized", True, r"added token 1 \('<s>'\) has normalized=true"),
]


@pytest.mark.parametrize("style, path, value, message", REFUSED, ids=[f"{s}-{p}-{v}" for s, p, v, _ in REFUSED])
def test_what_is_not_implemented_is_refused_by_name(style, path, value, message, request):
    data = edited(request.getfixturevalue(style)[1], path, value)
    with pytest.raises(ValueError, match=message):
        BPETokenizer.from_json(data, "tok.json")


def test_broken_files_are_refused(hf_gpt2, tmp_path):
    data = hf_gpt2[1]
    with pytest.raises(ValueError, match="merge 2 is 'a b c', not two tokens"):
        BPETokenizer.from_json(edited(data, "model.merges.2", "a b c"))
    with pytest.raises(ValueError, match=r"merge 0 \('Ġ', 'zz'\) uses 'zz', not in the vocabulary"):
        BPETokenizer.from_json(edited(data, "model.merges.0", ["Ġ", "zz"]))
    vocab = {token: i for token, i in data["model"]["vocab"].items() if i != 5}
    with pytest.raises(ValueError, match="id 5 is missing"):
        BPETokenizer.from_json(edited(edited(data, "model.vocab", vocab), "model.merges", []))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}))
    with pytest.raises(ValueError, match='tokenizer.json: model.type is "Unigram"'):
        load_tokenizer(tmp_path / "tokenizer.json")
