"""train.data.bpe: the byte-level and SentencePiece-style BPE, id for id against Hugging Face `tokenizers` on hostile
text (the references are trained in conftest.py), and its own rules: special tokens only when allowed, exact round
trips, errors that name the offset."""

import json

import numpy as np
import pytest

from tests.train.data.conftest import HOSTILE
from train.data import bpe
from train.data.bpe import BPETokenizer, merge_word
from train.data.bpe_split import bytes_to_unicode, split_special, split_words

STYLES = ["hf_gpt2", "hf_llama3", "hf_sentencepiece"]


def reference_ids(reference, text: str, specials: bool) -> list[int]:
    """Hugging Face's ids of `text`, the special tokens matched in it or not, nothing added in front."""
    reference.encode_special_tokens = not specials
    return reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("style", STYLES)
def test_ids_match_hugging_face_on_hostile_text(style, request):
    reference, data = request.getfixturevalue(style)
    ours = BPETokenizer.from_json(data)
    assert ours.style == {"hf_gpt2": "gpt2", "hf_llama3": "llama3", "hf_sentencepiece": "sentencepiece"}[style]
    assert ours.vocab_size == reference.get_vocab_size()
    for text in [*HOSTILE, "".join(HOSTILE), "\n".join(HOSTILE)]:
        assert ours.encode(text).tolist() == reference_ids(reference, text, specials=False), repr(text)
        everything = ours.encode(text, allowed_special="all").tolist()
        assert everything == reference_ids(reference, text, specials=True), repr(text)


@pytest.mark.parametrize("style", ["hf_gpt2", "hf_llama3"])
def test_byte_level_round_trips_exactly(style, request):
    ours = BPETokenizer.from_json(request.getfixturevalue(style)[1])
    for text in [*HOSTILE, "".join(HOSTILE)]:
        assert ours.decode(ours.encode(text)) == text
        assert ours.decode(ours.encode(text, allowed_special="all")) == text
        assert ours.encode(text.encode("utf-8")).tolist() == ours.encode(text).tolist()  # bytes in, same ids


def test_sentencepiece_decode_matches_hugging_face(hf_sentencepiece):
    reference, data = hf_sentencepiece
    ours = BPETokenizer.from_json(data)
    for text in HOSTILE:
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids.tolist(), skip_special_tokens=False), repr(text)
    assert any(token.startswith("<0x") for token in reference.encode(HOSTILE[8]).tokens)  # Thai: byte fallback


def test_special_tokens_only_when_allowed(hf_gpt2):
    ours = BPETokenizer.from_json(hf_gpt2[1])
    end = ours.special_tokens["<|endoftext|>"]
    text = "a<|endoftext|>b</s>"
    assert end not in ours.encode(text).tolist()  # ordinary text cannot forge a document boundary
    assert ours.encode(text, allowed_special={"<|endoftext|>"}).tolist().count(end) == 1
    assert ours.special_tokens["</s>"] not in ours.encode(text, allowed_special={"<|endoftext|>"}).tolist()
    assert ours.encode(text, allowed_special="all").tolist()[-1] == ours.special_tokens["</s>"]
    with pytest.raises(ValueError, match=r"allowed_special names \['<bos>'\]"):
        ours.encode(text, allowed_special={"<bos>"})
    with pytest.raises(ValueError, match="allowed_special is 'all' or a set of special tokens, got the string '</s>'"):
        ours.encode(text, allowed_special="</s>")


def test_special_tokens_leftmost_then_longest():
    assert split_special("x<s><s>>y", frozenset({"<s>", "<s>>"})) == [("x", False), ("<s>", True), ("<s>>", True)] + [
        ("y", False)
    ]
    assert split_special("", frozenset({"<s>"})) == []


def test_invalid_input_names_the_offset(hf_gpt2):
    ours = BPETokenizer.from_json(hf_gpt2[1])
    with pytest.raises(ValueError, match="not valid UTF-8 at byte offset 3"):
        ours.encode(b"abc\xff")
    with pytest.raises(ValueError, match="not valid UTF-8 at byte offset 2"):
        ours.encode("é".encode() + b"\xe2\x82")  # a cut character
    with pytest.raises(ValueError, match="not valid Unicode at position 1"):
        ours.encode("a\ud800b")
    with pytest.raises(ValueError, match=r"token ids \[700\] are outside"):
        ours.decode([700])
    assert ours.encode("").dtype == np.int64 and ours.encode("").size == 0


def test_words_match_hugging_face_pre_tokenizers():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import pre_tokenizers

    from train.data.bpe_split import LLAMA3_PATTERN

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    llama3 = pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated")
    alphabet = bytes_to_unicode()
    for text in HOSTILE:
        spelled = ["".join(alphabet[b] for b in word.encode()) for word in split_words(text, "gpt2")]
        assert spelled == [word for word, _ in gpt2.pre_tokenize_str(text)], repr(text)
        assert split_words(text, "llama3") == [word for word, _ in llama3.pre_tokenize_str(text)], repr(text)
    assert split_words("1234567 x", "llama3") == ["123", "456", "7", " x"]  # numbers in groups of 1 to 3 digits


def test_byte_alphabet_is_gpt2s():
    alphabet = bytes_to_unicode()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[ord("a")] == "a"
    assert alphabet[0] == "Ā" and alphabet[0xAD] == "Ń"  # moved bytes from U+0100, in byte order: the 68th


def test_merge_word_by_rank_by_hand():
    ranks = {("l", "o"): 0, ("lo", "w"): 1, ("e", "r"): 2, ("a", "a"): 3}
    assert merge_word(list("lower"), ranks) == ["low", "er"]
    assert merge_word(list("aaa"), ranks) == ["aa", "a"]  # left to right, no overlap
    assert merge_word(["x"], ranks) == ["x"] and merge_word([], ranks) == []


def test_a_vocabulary_converted_from_tiktoken_encodes_as_hugging_face_does(hf_llama3):
    """The Llama 3 style reference rewritten as Hugging Face's TikTokenConverter writes a tiktoken vocabulary:
    every split of a token into two tokens a merge, in the order of the tokens' ids, so a token has several
    merges and some use tokens of later ids. The same ids as Hugging Face on the hostile texts."""
    tokenizers = pytest.importorskip("tokenizers")
    data = json.loads(json.dumps(hf_llama3[1]))
    vocab = data["model"]["vocab"]
    data["model"]["merges"] = [
        [token[:cut], token[cut:]]
        for token in sorted(vocab, key=vocab.get)
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    ours, reference = BPETokenizer.from_json(data), tokenizers.Tokenizer.from_str(json.dumps(data))
    assert len(ours.merges) > len(hf_llama3[1]["model"]["merges"])
    for text in [*HOSTILE, "\n".join(HOSTILE), "aaaa bbbbbb cccccccc " * 3]:
        assert ours.encode(text).tolist() == reference_ids(reference, text, specials=False), repr(text)


def test_merges_listed_out_of_order_encode_as_hugging_face_does():
    """("aa", "a") listed before ("a", "a"), as a conversion may list them: the leftmost lowest pair, one at a
    time, as Hugging Face merges. "aaaa" is `aaa a`; merging every (a, a) at once, GPT-2's encoder.py way,
    would give `aa aa`. A merge listed twice ranks where it is listed last."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())} | {"aa": 256, "aaa": 257}
    tokenizer = BPETokenizer(vocab, (("aa", "a"), ("a", "a")))
    reference = tokenizers.Tokenizer.from_str(json.dumps(tokenizer.to_json()))
    assert merge_word(list("aaaa"), tokenizer._ranks) == ["aaa", "a"]
    for text in ["aaaa", "aaaaa", "aaaaaaa baaaab aa"]:
        assert tokenizer.encode(text).tolist() == reference_ids(reference, text, specials=False), text
    repeated = BPETokenizer(vocab | {"ab": 258, "bc": 259}, (("a", "b"), ("b", "c"), ("a", "b")))  # its last rank
    reference = tokenizers.Tokenizer.from_str(json.dumps(repeated.to_json()))
    assert repeated.encode("abc").tolist() == reference_ids(reference, "abc", specials=False) == [64, 259]


def test_unknown_characters_without_fallback():
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4}
    fused = BPETokenizer(vocab, (("▁", "a"),), {"<unk>": 0}, "sentencepiece", unk_token="<unk>", fuse_unk=True)
    assert fused.encode("a xyb").tolist() == [4, 1, 0, 3]
    with pytest.raises(ValueError, match=r"character 'x' \(U\+0078\) in the word '▁▁xa' has no token"):
        BPETokenizer(vocab, (), {}, "sentencepiece").encode(" xa")


def test_metaspace_matches_hugging_face_encode_and_decode(hf_metaspace):
    """Every prepend scheme, split into words or not: the ids of hostile text with and without special tokens
    matched (after a special token "first" puts no `▁`), the decoded text, and the tokenizer.json written back."""
    reference, data = hf_metaspace
    ours = BPETokenizer.from_json(data)
    assert (ours.style, ours.prepend_scheme, ours.split) == (
        "metaspace",
        *(data["pre_tokenizer"][k] for k in ("prepend_scheme", "split")),
    )
    for text in [*HOSTILE, "".join(HOSTILE), "\n".join(HOSTILE), "<s>after a special", "a<s> b<s>"]:
        assert ours.encode(text).tolist() == reference_ids(reference, text, specials=False), repr(text)
        everything = ours.encode(text, allowed_special="all")
        assert everything.tolist() == reference_ids(reference, text, specials=True), repr(text)
        fallback = any(token.startswith("<0x") for token in reference.encode(text).tokens)
        if data["decoder"]["type"] != "Metaspace" or not fallback:  # that decoder leaves `<0xE0>` as it is
            assert ours.decode(everything) == reference.decode(everything.tolist(), skip_special_tokens=False)
    again = BPETokenizer.from_json(ours.to_json())
    assert (again.prepend_scheme, again.split) == (ours.prepend_scheme, ours.split)


def test_a_metaspace_replacement_other_than_the_space_mark_is_refused(hf_metaspace):
    data = {**hf_metaspace[1], "pre_tokenizer": {**hf_metaspace[1]["pre_tokenizer"], "replacement": "_"}}
    with pytest.raises(ValueError, match=r'pre_tokenizer.replacement is "_"; only "\\u2581" is implemented'):
        BPETokenizer.from_json(data)


def test_the_word_cache_is_bounded_and_changes_no_id(hf_gpt2, monkeypatch):
    """A corpus of millions of distinct words must not grow the cache without bound: past CACHED_WORDS it starts
    afresh, and the ids are those of an encoder that never cleared it."""
    text = " ".join(HOSTILE) * 2
    want = BPETokenizer.from_json(hf_gpt2[1]).encode(text)
    monkeypatch.setattr(bpe, "CACHED_WORDS", 5)
    small = BPETokenizer.from_json(hf_gpt2[1])
    np.testing.assert_array_equal(small.encode(text), want)
    assert 0 < len(small._cache) <= 5
