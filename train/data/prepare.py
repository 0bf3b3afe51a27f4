"""Turn a corpus into a prepared dataset directory: `train.bin`, `val.bin`, `tokenizer.json`, `meta.json`.

The format is nanoGPT's: the token ids of the whole text, the first 90% in `train.bin` and the last 10% in
`val.bin`, each a headerless array of little-endian uint16 (so a nanoGPT `.bin` reads here, and ours there), or
of uint32 when the vocabulary has more than 65,536 ids (Llama 3's 128,256). Beside them:

- `tokenizer.json`: the tokenizer (see `tokenizers.py`), JSON rather than nanoGPT's pickled `meta.pkl`;
- `meta.json`: where the text came from and what was made of it: the source description and file list,
  the Python version, the text's size and SHA-256, the tokenizer kind and vocabulary size, the token files'
  dtype, the token counts.

`meta.json` is written last, and removed first when a directory is prepared again: a directory with all
four files is complete, whatever was interrupted.
"""

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np

from train.data.bpe import BPETokenizer
from train.data.bpe_bulk import encode_corpus
from train.data.corpus import Source
from train.data.tokenizers import Tokenizer, make_tokenizer, save_tokenizer

FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
# The token files' dtypes, by their name in meta.json: the narrowest that holds every id of the vocabulary.
DTYPES = {"uint16 little-endian": np.dtype("<u2"), "uint32 little-endian": np.dtype("<u4")}
MAX_VOCAB = 2**32


def token_dtype(vocab_size: int) -> str:
    """The name (a key of DTYPES) of the narrowest dtype whose values hold ids 0..vocab_size-1."""
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"a vocabulary of {vocab_size:,} ids is more than the {MAX_VOCAB:,} a uint32 token file holds")
    return "uint16 little-endian" if vocab_size <= 2**16 else "uint32 little-endian"


def text_sha256(text: str) -> str:
    """The hex SHA-256 of `text`'s UTF-8 bytes: the identity of a corpus."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def split_point(n_tokens: int) -> int:
    """How many of `n_tokens` go to train: the first 90%, rounded down (integer arithmetic, so exact)."""
    return n_tokens * 9 // 10


def check_writable(out_dir: str | Path, what: str = "the dataset") -> Path:
    """Create `out_dir` if needed and check that files can be written in it, before any work is done; an
    OSError naming `what` and the directory if not."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or e
        raise OSError(
            f"cannot write {what} to out_dir {str(out_dir)!r} (it is not writable: {reason}); choose another --out_dir"
        ) from None
    return out_dir


def _write_atomically(path: Path, write) -> None:
    """Call `write(tmp_path)`, then rename it to `path`, so `path` is never seen half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def prepare(
    source: Source,
    out_dir: str | Path,
    tokenizer: str | Tokenizer = "char",
    vocab_size: int | None = None,
    workers: int = 1,
) -> dict:
    """Tokenize `source.text` with a new tokenizer of kind `tokenizer` ("char", "byte", or "bpe": trained on
    the text to `vocab_size` tokens), or with `tokenizer` itself (a model's own), and write the dataset files
    into `out_dir`. Returns the contents of `meta.json`. A BPE encodes the text in pieces over `workers`
    processes (`bpe_bulk`: the same ids as one `encode` call).

    Raises ValueError for an empty text or one too short to split (fewer than 2 tokens); OSError if `out_dir`
    cannot be written.
    """
    out_dir = check_writable(out_dir)
    text = source.text
    if not text:
        raise ValueError(f"the input is empty ({source.description}); there is nothing to train on")
    tok = make_tokenizer(tokenizer, text, vocab_size) if isinstance(tokenizer, str) else tokenizer
    dtype = token_dtype(tok.vocab_size)
    ids = encode_corpus(tok, text, workers=workers) if isinstance(tok, BPETokenizer) else tok.encode(text)
    n_train = split_point(len(ids))
    if n_train == 0:
        raise ValueError(f"the input is {len(ids)} token(s) long: too short to split into train and val")
    meta = {
        "source": source.description,
        "files": source.files,
        "python_version": platform.python_version(),
        "text_chars": len(text),
        "text_bytes": len(text.encode("utf-8", "surrogatepass")),
        "text_sha256": text_sha256(text),
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "tokens": len(ids),
        "train_tokens": n_train,
        "val_tokens": len(ids) - n_train,
    }
    (out_dir / "meta.json").unlink(missing_ok=True)
    tokens = ids.astype(DTYPES[dtype])
    _write_atomically(out_dir / "train.bin", lambda p: tokens[:n_train].tofile(p))
    _write_atomically(out_dir / "val.bin", lambda p: tokens[n_train:].tofile(p))
    _write_atomically(out_dir / "tokenizer.json", lambda p: save_tokenizer(tok, p))
    _write_atomically(out_dir / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1) + "\n"))
    return meta
