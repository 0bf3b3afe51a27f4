"""train.data: corpus reading, tokenizers, the prepared files, ensure_dataset, batches and prefetch."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data import (
    SEPARATOR,
    ByteTokenizer,
    CharTokenizer,
    batches,
    ensure_dataset,
    get_batch,
    load_tokenizer,
    open_dataset,
    prefetch,
    read_source,
    stdlib_corpus,
)
from train.data.__main__ import main as cli

TEXT = "First Citizen:\r\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak! — ünïcödé ✓\n"
ROOT = Path(__file__).resolve().parents[2]


def prepared(tmp_path, text=TEXT, kind="char", name="input.txt"):
    """Write `text` to a file, prepare it with the CLI into tmp_path/out, return (out dir, meta)."""
    source = tmp_path / name
    source.write_text(text, encoding="utf-8", newline="")
    out = tmp_path / "out"
    return out, cli(["--input", str(source), "--tokenizer", kind, "--out_dir", str(out)])


# --- prepared files -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_prepare_file_split_dtype_and_exact_round_trip(tmp_path, kind):
    out, meta = prepared(tmp_path, kind=kind)
    train = np.fromfile(out / "train.bin", dtype="<u2")
    val = np.fromfile(out / "val.bin", dtype="<u2")
    tokenizer = load_tokenizer(out / "tokenizer.json")
    n = len(TEXT) if kind == "char" else len(TEXT.encode("utf-8"))
    assert len(train) + len(val) == n == meta["tokens"]
    assert len(train) == n * 9 // 10 == meta["train_tokens"]  # the first 90%, rounded down
    assert tokenizer.decode(np.concatenate([train, val])) == TEXT  # exact, \r\n included
    data = open_dataset(out)
    assert data.train.dtype == np.uint16 and data.val.dtype == np.uint16
    np.testing.assert_array_equal(data.train, train)
    assert meta["vocab_size"] == (len(set(TEXT)) if kind == "char" else 256)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["text_sha256"] == __import__("hashlib").sha256(TEXT.encode()).hexdigest()


def test_char_ids_are_sorted_character_order(tmp_path):
    out, _ = prepared(tmp_path, text="banana")
    tokens = np.concatenate([np.fromfile(out / f, dtype="<u2") for f in ("train.bin", "val.bin")])
    np.testing.assert_array_equal(tokens, [1, 0, 2, 0, 2, 0])  # a=0, b=1, n=2, as nanoGPT's stoi


def test_directory_reads_text_files_sorted_and_skips_hidden_and_others(tmp_path):
    corpus = tmp_path / "corpus"
    files = {"b.txt": "bee", "a/z.md": "zed", "a/y.py": "why", "c.TXT": "sea"}
    skipped = {"notes.bin": "x", "README": "x", ".hidden.txt": "x", ".git/x.txt": "x", "empty.txt": ""}
    for rel, text in {**files, **skipped}.items():
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(text)
    source = read_source(corpus)
    assert source.files == ["a/y.py", "a/z.md", "b.txt", "c.TXT"]
    assert source.text is None and source.read_text() == SEPARATOR.join(["why", "zed", "bee", "sea"])
    out = tmp_path / "out"
    cli(["--input", str(corpus), "--out_dir", str(out)])
    data = open_dataset(out)
    assert data.tokenizer.decode(np.concatenate([data.train, data.val])) == source.read_text()
    assert data.meta["files"] == source.files


def test_cli_runs_as_a_module(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, hello data")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "train.data", "--input", "t.txt", "--tokenizer", "byte"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "20 train and 3 val tokens" in result.stdout
    assert re.search(r"^encoded 0.0 of 0.0 MB \(100%\), [\d.]+ MB/s, in [\d.]+ s$", result.stderr, re.M), result.stderr
    assert open_dataset(tmp_path / "data" / "t-byte").meta["tokenizer"] == "byte"  # default out_dir


# --- errors ---------------------------------------------------------------------------------------------


def cli_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_errors(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in cli_error(capsys, "--input", str(tmp_path / "empty.txt"), "--out_dir", str(tmp_path / "o"))
    (tmp_path / "one.txt").write_text("x")
    assert "too short" in cli_error(capsys, "--input", str(tmp_path / "one.txt"), "--out_dir", str(tmp_path / "o"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    assert "empty" in cli_error(capsys, "--input", str(tmp_path / "blank"), "--out_dir", str(tmp_path / "o"))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "image.png").write_bytes(b"\x89PNG")
    message = cli_error(capsys, "--input", str(tmp_path / "bare"), "--out_dir", str(tmp_path / "o"))
    assert "no text files under" in message and "bare" in message
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    message = cli_error(capsys, "--input", str(tmp_path / "latin1.txt"), "--out_dir", str(tmp_path / "o"))
    assert "latin1.txt is not UTF-8" in message and "byte 3" in message
    # An out_dir that cannot be created (its parent is a file): named, and nothing else is done first.
    (tmp_path / "afile").write_text("")
    message = cli_error(capsys, "--input", str(tmp_path / "one.txt"), "--out_dir", str(tmp_path / "afile" / "out"))
    assert "cannot write the dataset to out_dir" in message and "afile" in message


def test_missing_input_error_names_the_path(tmp_path, capsys):
    message = cli_error(capsys, "--input", str(tmp_path / "nope.txt"))
    assert str(tmp_path / "nope.txt") in message and "does not exist" in message


def test_a_vocabulary_past_uint16_is_written_in_uint32_and_reads_back(tmp_path):
    """65,537 distinct characters (skipping the surrogates, which UTF-8 cannot hold): one id past what uint16
    holds, so both token files are uint32, 4 bytes a token, as meta.json says; train.eval's --ids reads them too."""
    from train import eval as eval_program

    chars = [chr(c) for c in range(0x20, 0x20 + 65537 + 2048) if not 0xD800 <= c <= 0xDFFF][:65537]
    out, meta = prepared(tmp_path, text="".join(chars))
    data = open_dataset(out)
    assert meta["dtype"] == "uint32 little-endian" and meta["vocab_size"] == 65537
    assert data.train.dtype == np.uint32 and (out / "val.bin").stat().st_size == 4 * meta["val_tokens"]
    assert data.tokenizer.decode(np.concatenate([data.train, data.val])) == "".join(chars)
    assert int(np.concatenate([data.train, data.val]).max()) == 65536
    np.testing.assert_array_equal(eval_program.read_ids(str(out / "val.bin")), data.val)
    meta["dtype"] = "int8"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="names token dtype 'int8'; known: uint16 little-endian, uint32"):
        open_dataset(out)


def test_open_dataset_errors(tmp_path):
    out, _ = prepared(tmp_path)
    (out / "val.bin").write_bytes((out / "val.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="val.bin holds .* truncated"):
        open_dataset(out)
    (out / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="lacks tokenizer.json"):
        open_dataset(out)


# --- tokenizers -----------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    ids = ByteTokenizer().encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))  # independent reference: Python's own encoder
    assert ByteTokenizer().decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1))
def test_char_tokenizer_round_trips_and_matches_a_dict_lookup(text):
    tokenizer = CharTokenizer.from_text(text)
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}  # nanoGPT's prepare.py, written out
    assert tokenizer.encode(text).tolist() == [stoi[c] for c in text]
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_char_tokenizer_in_any_vocabulary_order():
    tokenizer = CharTokenizer(("z", "a", "m"))
    assert tokenizer.encode("amz").tolist() == [1, 2, 0]
    assert tokenizer.decode([0, 1, 2]) == "zam"


def test_char_tokenizer_unknown_characters():
    tokenizer = CharTokenizer.from_text("hello world")
    with pytest.raises(ValueError, match=r"'é' \(U\+00E9\).*position 1"):
        tokenizer.encode("hé")
    assert tokenizer.decode(tokenizer.encode("héllo wörld", unknown=" ")) == "h llo w rld"
    with pytest.raises(ValueError, match=r"replacement unknown='\?' is not in the vocabulary"):
        tokenizer.encode("hé", unknown="?")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 3\)"):
        CharTokenizer.from_text("abc").decode([0, 3])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        ByteTokenizer().decode([256])
    with pytest.raises(ValueError, match="1-D"):
        ByteTokenizer().decode(np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="repeats characters"):
        CharTokenizer(("a", "a"))
    with pytest.raises(ValueError, match="single characters"):
        CharTokenizer(("ab",))
    (tmp_path / "bad.json").write_text('{"kind": "wordpiece"}')
    with pytest.raises(ValueError, match=r"bad.json: 'kind' must be one of \['byte', 'char'\]"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_bytes(b"\x80\x04K\x01.")  # a pickle is not read, let alone run
    with pytest.raises(ValueError, match="junk.json is not a JSON tokenizer file"):
        load_tokenizer(tmp_path / "junk.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        load_tokenizer(tmp_path / "none.json")
    ByteTokenizer().save(tmp_path / "byte.json")
    with pytest.raises(ValueError, match="holds a 'byte' tokenizer, not a 'char' one"):
        CharTokenizer.load(tmp_path / "byte.json")


def test_byte_decode_replaces_a_cut_character():
    ids = ByteTokenizer().encode("é")  # two bytes
    assert ByteTokenizer().decode(ids[:1]) == "\ufffd"


@pytest.mark.parametrize("tokenizer", [CharTokenizer.from_text(TEXT), ByteTokenizer()], ids=["char", "byte"])
def test_tokenizer_saves_as_plain_json(tmp_path, tokenizer):
    tokenizer.save(tmp_path / "tokenizer.json")
    data = json.loads((tmp_path / "tokenizer.json").read_text())  # plain JSON: no pickle anywhere
    assert data["kind"] == tokenizer.kind
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded == tokenizer and type(loaded) is type(tokenizer)
    assert loaded.decode(loaded.encode(TEXT)) == TEXT


# --- default corpus and ensure_dataset ------------------------------------------------------------------


def test_default_corpus_builds_within_its_documented_size(tmp_path):
    lines = []
    path = ensure_dataset(None, data_root=tmp_path, log=lines.append)
    assert path == tmp_path / "stdlib" and len(lines) == 1
    meta = open_dataset(path).meta
    assert 900_000 <= meta["text_chars"] <= 1_400_000  # docs/data.md: 0.98 M (3.8) to 1.17 M (3.13)
    assert 90 <= meta["vocab_size"] <= 130
    assert meta["python_version"] == __import__("platform").python_version()
    assert meta["text_sha256"] == __import__("hashlib").sha256(stdlib_corpus().text.encode()).hexdigest()
    assert meta["files"][0] == "pydoc_data.topics" and "argparse" in meta["files"]
    assert ensure_dataset("stdlib", data_root=tmp_path, log=lines.append) == path and len(lines) == 1  # reused


def test_ensure_dataset_prepares_raw_text_once_into_a_content_named_cache(tmp_path):
    text_file = tmp_path / "poems.txt"
    text_file.write_text("roses are red, violets are blue")
    lines = []
    first = ensure_dataset(text_file, data_root=tmp_path / "data", log=lines.append)
    assert first.parent == tmp_path / "data" / "cache" and first.name.startswith("poems-char-")
    assert ensure_dataset(text_file, data_root=tmp_path / "data", log=lines.append) == first and len(lines) == 1
    text_file.write_text("roses are red, violets are blue, sugar is sweet")
    changed = ensure_dataset(text_file, data_root=tmp_path / "data", log=None)
    assert changed != first and open_dataset(changed).meta["text_chars"] == 47
    byte = ensure_dataset(text_file, tokenizer="byte", data_root=tmp_path / "data", log=None)
    assert open_dataset(byte).meta["tokenizer"] == "byte"


def test_ensure_dataset_accepts_prepared_directories_by_path_or_name(tmp_path):
    out, _ = prepared(tmp_path)
    assert ensure_dataset(out) == out
    assert ensure_dataset("out", data_root=tmp_path) == tmp_path / "out"  # a name inside data_root
    with pytest.raises(ValueError, match="prepared with the 'char' tokenizer, not 'byte'"):
        ensure_dataset(out, tokenizer="byte")
    (out / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="partly prepared dataset: it lacks meta.json"):
        ensure_dataset(out)
    with pytest.raises(FileNotFoundError, match="dataset 'nowhere' not found"):
        ensure_dataset("nowhere", data_root=tmp_path)
    with pytest.raises(ValueError, match="tokenizer must be 'char' or 'byte'"):
        ensure_dataset(out, tokenizer="bpe")


# --- batches --------------------------------------------------------------------------------------------

RAMP = np.arange(1000, dtype=np.uint16)  # token i is i: a batch row's first token is its offset


def test_get_batch_shapes_shift_and_offsets():
    x, y = get_batch(RAMP, batch_size=64, block_size=16, seed=0, step=0)
    assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == np.int32
    offsets = x[:, 0]
    np.testing.assert_array_equal(x, offsets[:, None] + np.arange(16))  # contiguous windows of the data
    np.testing.assert_array_equal(y, x + 1)  # y is x shifted by one token
    assert offsets.min() >= 0 and offsets.max() <= 1000 - 16 - 1


def test_get_batch_reaches_every_offset_and_no_further():
    data = np.arange(20, dtype=np.uint16)
    x, y = get_batch(data, batch_size=500, block_size=17, seed=1, step=0)
    assert set(x[:, 0].tolist()) == {0, 1, 2}  # the last window ends at the last token
    assert y.max() == 19


def test_get_batch_is_a_function_of_seed_step_and_stream():
    def batch(seed=0, step=5, stream=0):
        return np.concatenate(get_batch(RAMP, 8, 32, seed, step, stream))

    np.testing.assert_array_equal(batch(), batch())
    for other in (batch(step=6), batch(seed=1), batch(stream=1)):
        assert not np.array_equal(batch(), other)


def test_batches_resume_where_a_run_stopped():
    later = batches(RAMP, 4, 8, seed=3, start_step=10)
    for step in range(10, 13):
        np.testing.assert_array_equal(next(later)[0], get_batch(RAMP, 4, 8, 3, step)[0])


def test_get_batch_gathers_with_one_index_not_one_per_sample():
    class Counting(np.ndarray):
        calls = 0

        def __getitem__(self, index):
            Counting.calls += 1
            return super().__getitem__(index)

    data = RAMP.view(Counting)
    x, _ = get_batch(data, batch_size=256, block_size=8, seed=0, step=0)
    assert Counting.calls == 1
    np.testing.assert_array_equal(x, get_batch(RAMP, 256, 8, 0, 0)[0])


def test_get_batch_from_a_memmap(tmp_path):
    out, _ = prepared(tmp_path, text=TEXT * 20)
    data = open_dataset(out)
    x, y = get_batch(data.train, 4, 10, seed=0, step=0)
    np.testing.assert_array_equal(x, get_batch(np.array(data.train), 4, 10, 0, 0)[0])
    assert data.tokenizer.decode(x[0]) in TEXT * 20


def test_get_batch_errors():
    with pytest.raises(ValueError, match="block_size 1000 needs at least 1001 tokens .* only 1000"):
        get_batch(RAMP, 2, 1000, 0, 0)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        get_batch(RAMP, 2, 8, 0, -1)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        get_batch(RAMP, 0, 8, 0, 0)


def test_prefetch_keeps_order_puts_on_device_and_reads_only_size_ahead():
    drawn = []

    def source():
        for step in range(5):
            drawn.append(step)
            yield get_batch(RAMP, 2, 4, 0, step)

    stream = prefetch(source(), size=2)
    first = next(stream)
    assert drawn == [0, 1]  # one in use, one in flight
    assert isinstance(first[0], jax.Array) and first[0].devices() == {jax.devices()[0]}
    rest = list(stream)
    for step, (x, y) in enumerate([first, *rest]):
        np.testing.assert_array_equal(x, get_batch(RAMP, 2, 4, 0, step)[0])
        np.testing.assert_array_equal(y, get_batch(RAMP, 2, 4, 0, step)[1])
    with pytest.raises(ValueError, match="prefetch size must be an integer >= 1, got 0"):
        next(prefetch(source(), size=0))


def test_cli_encodes_with_a_given_tokenizer_json(tmp_path, capsys):
    """--tokenizer PATH: a model's own tokenizer (here one trained on another text) encodes the input."""
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n" * 30)
    (tmp_path / "b.txt").write_text("a mat for the cat\n" * 20)
    cli(
        [
            "--input",
            str(tmp_path / "a.txt"),
            "--tokenizer",
            "bpe",
            "--vocab_size",
            "270",
            "--out_dir",
            str(tmp_path / "a"),
        ]
    )
    saved = tmp_path / "a" / "tokenizer.json"
    cli(["--input", str(tmp_path / "b.txt"), "--tokenizer", str(saved), "--out_dir", str(tmp_path / "b")])
    data = open_dataset(tmp_path / "b")
    tokenizer = load_tokenizer(saved)
    assert data.tokenizer.to_json() == tokenizer.to_json()
    want = tokenizer.encode((tmp_path / "b.txt").read_text())
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), want)
    err = capsys.readouterr().err
    assert "of 0.0 MB (100%)" in err  # the progress line
    tiktoken = importlib.util.find_spec("tiktoken") is not None
    assert "encoding with " + ("tiktoken (exact" if tiktoken else "the readable encoder (tiktoken is not") in err
    message = cli_error(capsys, "--input", str(tmp_path / "b.txt"), "--tokenizer", str(tmp_path / "none.json"))
    assert "none.json' is not char, byte, bpe, nor a tokenizer.json file" in message
    b = ["--input", str(tmp_path / "b.txt")]
    for encoder in ("readable", "tiktoken", "tokenizers"):  # the reference, and the others where installed
        if encoder != "readable" and importlib.util.find_spec(encoder) is None:
            continue
        cli([*b, "--tokenizer", str(saved), "--encoder", encoder, "--out_dir", str(tmp_path / encoder)])
        data = open_dataset(tmp_path / encoder)
        np.testing.assert_array_equal(np.concatenate([data.train, data.val]), want)
    message = cli_error(capsys, *b, "--tokenizer", "byte", "--encoder", "tiktoken", "--out_dir", str(tmp_path))
    assert "tiktoken encodes a byte-level BPE, not a 'byte' tokenizer" in message
