"""Find, prepare when needed, and open a dataset: what a training program calls.

path = ensure_dataset(None)          # the default corpus, prepared into data/stdlib on first use
path = ensure_dataset("poems.txt")   # raw text: prepared once into a cache dir named by its content
path = ensure_dataset("data/shakespeare_char")   # an already prepared directory, used as it is
data = open_dataset(path)            # data.train / data.val are uint16 (or uint32) memmaps, data.tokenizer decodes
"""

import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from train.data.corpus import read_source, stdlib_corpus
from train.data.prepare import DTYPES, FILES, prepare, source_sha256
from train.data.tokenizers import Tokenizer, load_tokenizer

DEFAULT = "stdlib"  # the name of the built-in corpus (see corpus.stdlib_corpus)


class Dataset(NamedTuple):
    """A prepared dataset, opened. `train` and `val` are read-only memmaps: nothing is loaded until used."""

    path: Path
    train: np.memmap
    val: np.memmap
    tokenizer: Tokenizer
    meta: dict


def default_dir(data_root: str | Path, name: str, tokenizer: str) -> Path:
    """`data_root/name` for the char tokenizer, `data_root/name-byte` for the byte one (`name-<kind>` for another)."""
    return Path(data_root) / (name if tokenizer == "char" else f"{name}-{tokenizer}")


def missing_files(path: Path) -> list[str]:
    """The dataset files (`FILES`) that `path` lacks; empty when it is a prepared dataset."""
    return [f for f in FILES if not (path / f).is_file()]


def token_file_dtype(meta: dict, path: Path) -> np.dtype:
    """The token files' dtype that meta.json names; uint16 when it names none (nanoGPT's files)."""
    name = meta.get("dtype", "uint16 little-endian")
    if name not in DTYPES:
        raise ValueError(f"{path / 'meta.json'} names token dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def _open_split(path: Path, expected: int, dtype: np.dtype) -> np.memmap:
    size = path.stat().st_size
    if size != expected * dtype.itemsize:
        raise ValueError(
            f"{path} holds {size} bytes, but meta.json says {expected} {dtype.name} tokens "
            f"({expected * dtype.itemsize} bytes): the file is truncated or from another preparation; prepare the "
            "dataset again"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def open_dataset(path: str | Path) -> Dataset:
    """Open the prepared dataset directory `path`, checking that its files are all there and agree."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no dataset directory at {path}; prepare one with `python -m train.data`")
    if missing := missing_files(path):
        raise FileNotFoundError(
            f"{path} is not a prepared dataset: it lacks {', '.join(missing)}; prepare it with "
            f"`python -m train.data --input <text file or dir> --out_dir {path}`"
        )
    meta = json.loads((path / "meta.json").read_text())
    tokenizer = load_tokenizer(path / "tokenizer.json")
    if tokenizer.vocab_size != meta.get("vocab_size"):
        raise ValueError(
            f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens but meta.json says {meta.get('vocab_size')}; "
            "prepare the dataset again"
        )
    dtype = token_file_dtype(meta, path)
    train = _open_split(path / "train.bin", meta["train_tokens"], dtype)
    val = _open_split(path / "val.bin", meta["val_tokens"], dtype)
    return Dataset(path, train, val, tokenizer, meta)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, str | int]:
    """What identifies a tokenizer: its kind, vocabulary size and the SHA-256 of its JSON (the same characters
    with other ids differ)."""
    saved = json.dumps(tokenizer.to_json(), sort_keys=True).encode()
    return {
        "kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "sha256": hashlib.sha256(saved).hexdigest()[:16],
    }


def fingerprint(dataset: Dataset) -> dict[str, dict]:
    """What identifies the dataset's content, recorded in every checkpoint so that a resume on other data is
    refused: the tokenizer (`tokenizer_fingerprint`) and each token file's size and CRC-32 (reading both files
    once, about a second per GB)."""
    return {
        "tokenizer": tokenizer_fingerprint(dataset.tokenizer),
        **{name: _file_fingerprint(dataset.path / name) for name in ("train.bin", "val.bin")},
    }


def _file_fingerprint(path: Path) -> dict[str, int | str]:
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 * 2**20):
            crc = zlib.crc32(piece, crc)
    return {"bytes": path.stat().st_size, "crc32": f"{crc:08x}"}


def ensure_dataset(
    name_or_path: str | Path | None = None,
    *,
    tokenizer: str | Tokenizer | None = None,
    data_root: str | Path = "data",
    log: Callable[[str], None] | None = print,
) -> Path:
    """The directory of a prepared dataset, preparing it first if needed.

    `name_or_path` is, in the order tried:
      - None or "stdlib": the default corpus, prepared into `data_root/stdlib` (`stdlib-byte` for the byte
        tokenizer) unless already there;
      - a prepared directory (one holding train.bin, val.bin, tokenizer.json and meta.json): used as it is;
      - a text file or a directory of text files: prepared into `data_root/cache/<name>-<kind>-<hash>`,
        named by the text's SHA-256, so editing the text prepares it again and nothing stale is reused;
      - the name of a prepared directory inside `data_root` (nanoGPT's `dataset=shakespeare_char`).
    `tokenizer` ("char" or "byte") is the kind to prepare with (default "char"); for a prepared directory it
    must match the saved one if given. It may also be a tokenizer itself (a model's own, such as GPT-2's BPE):
    the text is then encoded with it, into a directory whose name holds its fingerprint as well (`<kind>` is
    `bpe-<sha256>`), and a prepared directory must hold the same tokenizer. A text is encoded over a process
    per core when it is large (`prepare`). `log` receives a line when something is prepared, and a progress
    line goes to stderr then (None: silent).
    """
    if isinstance(tokenizer, str) and tokenizer not in ("char", "byte"):
        raise ValueError(f"tokenizer must be 'char' or 'byte', got {tokenizer!r}")
    given = None if tokenizer is None or isinstance(tokenizer, str) else tokenizer
    kind = f"{given.kind}-{tokenizer_fingerprint(given)['sha256'][:8]}" if given else tokenizer or "char"
    say = log or (lambda line: None)
    if name_or_path is None or str(name_or_path) == DEFAULT:
        out = default_dir(data_root, DEFAULT, kind)
        if missing_files(out):
            say(f"preparing the default corpus (Python's own documentation and source) into {out}")
            prepare(stdlib_corpus(), out, given or kind)
        return out
    path = Path(name_or_path)
    if not path.exists() and (Path(data_root) / path).is_dir():
        path = Path(data_root) / path
    if path.is_dir() and len(missing_files(path)) < len(FILES):  # some dataset files: meant as prepared
        _check_prepared(path, tokenizer)
        return path
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {str(name_or_path)!r} not found: it is not a file or directory, nor a prepared dataset in "
            f"{data_root}/; name a text file, a directory of text, a prepared dataset directory, or leave it "
            f"out for the default corpus"
        )
    source = read_source(path)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.resolve().stem) or "text"
    out = Path(data_root) / "cache" / f"{stem}-{kind}-{source_sha256(source)[:12]}"
    if missing_files(out):
        say(f"preparing {source.description} into {out}")
        prepare(source, out, given or kind, workers=os.cpu_count() or 1, progress=log is not None)
    return out


def _check_prepared(path: Path, tokenizer: str | Tokenizer | None) -> None:
    """That the prepared directory `path` is complete and was prepared with `tokenizer` (a kind or a tokenizer
    itself) if given: FileNotFoundError or ValueError saying what differs."""
    if missing := missing_files(path):
        raise FileNotFoundError(
            f"{path} looks like a partly prepared dataset: it lacks {', '.join(missing)}; prepare it again"
        )
    if isinstance(tokenizer, str):
        saved = json.loads((path / "meta.json").read_text()).get("tokenizer")
        if saved != tokenizer:
            raise ValueError(f"{path} was prepared with the {saved!r} tokenizer, not {tokenizer!r}")
    elif tokenizer is not None:
        saved, wanted = tokenizer_fingerprint(load_tokenizer(path / "tokenizer.json")), tokenizer_fingerprint(tokenizer)
        if saved != wanted:
            raise ValueError(
                f"{path} was prepared with another tokenizer ({_describe(saved)}) than the model's "
                f"({_describe(wanted)}), so its ids mean other tokens; name the text itself instead, to have it "
                "prepared with the model's tokenizer"
            )


def _describe(tokenizer: dict) -> str:
    return f"{tokenizer['kind']}, {tokenizer['vocab_size']} tokens, sha256 {tokenizer['sha256']}"
