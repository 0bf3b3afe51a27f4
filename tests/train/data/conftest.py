"""The reference BPE tokenizers of the BPE tests, built offline with Hugging Face `tokenizers` itself: each trained
by its `BpeTrainer` on a small hostile corpus, in one of the three styles `train.data.bpe` reads."""

import json

import pytest

# Every script, emoji sequences, combining marks, runs of white space, digits, contractions, special-token strings.
HOSTILE = [
    "",
    "Hello, World! The quick brown fox jumps over the lazy dog.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε· ελληνικά γράμματα",
    "مرحبا بالعالم، هذا نص عربي",
    "שלום עולם, זה טקסט בעברית",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "नमस्ते दुनिया, यह हिन्दी है",
    "สวัสดีชาวโลก ภาษาไทย",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 😀😃 🧑🏿‍🚀",
    "e\u0301 combining: a\u0308\u0301 n\u0303 Zalgo: Z\u0351\u0352\u0353o\u0489",
    "spaces    and\ttabs\t\t and\n\n\nnewlines \r\n  \n\t end   ",
    "digits 1 12 123 1234 12345 1234567 3.14159 1,000,000 ٣٤٥ ४२ ½ Ⅻ",
    "it's don't they're we've I'm you'll he'd IT'S DON'T THEY'RE WE'VE I'M YOU'LL HE'D 's 'x",
    "special strings <|endoftext|> <s> </s> <|begin_of_text|><unk> inside text <|endoftext|>",
    "odd spaces\u00a0nbsp\u2003em\u3000ideographic\x1cfile\x0bvertical\u200bzero-width \u2028line",
    "code: def f(x):\n    return x**2  # comment\n\n\n",
    "  leading and trailing  ",
    "\u017f long s, Kelvin \u212a, '\u017f 'K \u00df\u1e9e",
    "\n",
    " ",
]
SPECIALS = ["<|endoftext|>", "<s>", "</s>"]
# Llama 2's decoder as Hugging Face writes it: `▁` back to spaces, byte tokens to bytes, the first space off.
SENTENCEPIECE_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _corpus(texts: list[str]) -> list[str]:
    english = "the cat sat on the mat; the dog's toy isn't here. We'll see 12 cats at 3pm.\n"
    return [english * 3, *texts, *texts]


def _train(tokenizer, texts: list[str], vocab_size: int, specials: list[str], byte_level: bool) -> dict:
    from tokenizers import pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(_corpus(texts), trainer)
    return json.loads(tokenizer.to_str())


@pytest.fixture(scope="session")
def hf_gpt2():
    """GPT-2 byte-level style: the ByteLevel pre-tokenizer with GPT-2's pattern. Returns (tokenizer, its JSON)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    data = _train(tokenizer, HOSTILE, 700, SPECIALS, byte_level=True)
    return tokenizer, data


@pytest.fixture(scope="session")
def hf_llama3():
    """Llama 3 style: Split on Llama 3's pattern, then ByteLevel without its regex; merges ignored for whole words."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    from train.data.bpe_split import LLAMA3_PATTERN

    tokenizer = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    split = pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    data = _train(tokenizer, HOSTILE, 700, ["<|begin_of_text|>", "<|end_of_text|>"], byte_level=True)
    data["model"]["ignore_merges"] = True  # as Llama 3's own file has it, whatever the trainer kept
    return tokenizers.Tokenizer.from_str(json.dumps(data)), data


@pytest.fixture(scope="session")
def hf_sentencepiece():
    """Llama 2 style: Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, `<unk>`, `<s>`, `</s>`, and the 256 byte
    tokens `<0x00>`..`<0xFF>` (ids 3..258, as in Llama 2) for byte fallback. Trained without the Thai, Devanagari
    and emoji lines, so those fall back to bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    seen = [text for text in HOSTILE if not any(mark in text for mark in ("ส", "न", "👍"))]
    data = _train(tokenizer, seen, 500, ["<unk>", "<s>", "</s>"], byte_level=False)
    trained = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    tokens = [token for token, _ in trained[:3]] + byte_tokens + [token for token, _ in trained[3:]]
    data["model"]["vocab"] = {token: i for i, token in enumerate(tokens)}
    data["decoder"] = SENTENCEPIECE_DECODER
    return tokenizers.Tokenizer.from_str(json.dumps(data)), data


@pytest.fixture(scope="session")
def hf_sentencepiece_by_words():
    """Llama 2 style as SentencePiece trains it, splitting at white space: the merges learned on `▁`-words
    (Metaspace), then written with hf_sentencepiece's normalizers and no pre-tokenizer, so no merge joins a
    symbol ending in another character to one starting with `▁`. Returns (tokenizer, its JSON)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    data = _train(tokenizer, HOSTILE, 500, ["<unk>", "<s>", "</s>"], byte_level=False)
    trained = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256) if f"<0x{byte:02X}>" not in data["model"]["vocab"]]
    tokens = [token for token, _ in trained[:3]] + byte_tokens + [token for token, _ in trained[3:]]
    data["model"]["vocab"] = {token: i for i, token in enumerate(tokens)}
    data["pre_tokenizer"] = None
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    data["decoder"] = SENTENCEPIECE_DECODER
    return tokenizers.Tokenizer.from_str(json.dumps(data)), data


@pytest.fixture(scope="session", params=[("first", True), ("always", True), ("never", True), ("first", False)])
def hf_metaspace(request):
    """Mistral's and newer Llama conversions' form: the Metaspace pre-tokenizer (each prepend scheme, with and
    without its split into words) and decoder, no normalizer, `<unk>`, `<s>`, `</s>` and byte fallback; the
    Thai, Devanagari and emoji lines left out of training, so they fall back to bytes. Returns (tokenizer, JSON)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    scheme, split = request.param
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
    if scheme == "first":  # as Mistral's tokenizer.json: Llama 2's decoder, which turns byte tokens into bytes
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:  # the Metaspace decoder, which leaves byte tokens as their names
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
    seen = [text for text in HOSTILE if not any(mark in text for mark in ("ส", "न", "👍"))]
    data = _train(tokenizer, seen, 500, ["<unk>", "<s>", "</s>"], byte_level=False)
    trained = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256) if f"<0x{byte:02X}>" not in data["model"]["vocab"]]
    tokens = [token for token, _ in trained[:3]] + byte_tokens + [token for token, _ in trained[3:]]
    data["model"]["vocab"] = {token: i for i, token in enumerate(tokens)}
    return tokenizers.Tokenizer.from_str(json.dumps(data)), data
