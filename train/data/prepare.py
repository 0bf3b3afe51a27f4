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

The corpus streams through (`prepare`), so one larger than memory prepares in memory of a few megabytes:
its ids go to a token file as they are encoded, which becomes `train.bin` once its last tenth is copied out
to `val.bin`.
"""

import hashlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

from train.data.bpe_bulk import PIECE_CHARS, WORD_CUT, cut, cut_pattern, encode_pieces
from train.data.bpe_fast import fast_encoder
from train.data.corpus import Source
from train.data.progress import Progress
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


def source_sha256(source: Source) -> str:
    """The hex SHA-256 of the UTF-8 bytes of `source`'s whole text, read a chunk at a time: the identity of a
    corpus."""
    digest = hashlib.sha256()
    for text, _ in source.chunks():
        digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


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
    progress: bool = False,
    encoder: str = "auto",
) -> dict:
    """Tokenize `source` with a new tokenizer of kind `tokenizer` ("char", "byte", or "bpe": trained on the
    text to `vocab_size` tokens), or with `tokenizer` itself (a model's own), and write the dataset files into
    `out_dir`. Returns the contents of `meta.json`.

    The text streams through: read a chunk at a time, cut into pieces where no token crosses, encoded by
    `encoder` (`bpe_fast.ENCODERS`; "auto": tiktoken when it is installed and exact for the BPE, else the
    readable encoder in `workers` processes), appended to the token file as they come (`bpe_bulk`), so memory
    holds a few pieces whatever the corpus's size. Building a tokenizer reads the text once more first.
    `progress` prints the encoder and a progress line on stderr.

    Raises ValueError for an empty text or one too short to split (fewer than 2 tokens); OSError if `out_dir`
    cannot be written.
    """
    out_dir = check_writable(out_dir)
    if source.size_bytes() == 0:
        raise ValueError(f"the input is empty ({source.description}); there is nothing to train on")
    if isinstance(tokenizer, str):
        tokenizer = make_tokenizer(
            tokenizer, cut((text for text, _ in source.chunks()), WORD_CUT, PIECE_CHARS), vocab_size
        )
    dtype = token_dtype(tokenizer.vocab_size)
    (out_dir / "meta.json").unlink(missing_ok=True)
    tokens_path = out_dir / ".tokens.tmp"
    try:
        text_fields = _write_tokens(tokenizer, source, tokens_path, DTYPES[dtype], workers, progress, encoder)
        n_tokens = tokens_path.stat().st_size // DTYPES[dtype].itemsize
        n_train = split_point(n_tokens)
        if n_train == 0:
            raise ValueError(f"the input is {n_tokens} token(s) long: too short to split into train and val")
        _split(tokens_path, out_dir, n_train, DTYPES[dtype].itemsize)
    finally:
        tokens_path.unlink(missing_ok=True)
    meta = {
        "source": source.description,
        "files": source.files,
        "python_version": platform.python_version(),
        **text_fields,
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "tokens": n_tokens,
        "train_tokens": n_train,
        "val_tokens": n_tokens - n_train,
    }
    _write_atomically(out_dir / "tokenizer.json", lambda p: save_tokenizer(tokenizer, p))
    _write_atomically(out_dir / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1) + "\n"))
    return meta


def _write_tokens(
    tokenizer: Tokenizer, source: Source, path: Path, dtype: np.dtype, workers: int, progress: bool, encoder: str
) -> dict:
    """Encode `source` into `path`, ids appended as they come; returns what meta.json says of the text: its
    characters, UTF-8 bytes and SHA-256, counted on the way."""
    total = source.size_bytes()
    digest, counts = hashlib.sha256(), {"text_chars": 0, "text_bytes": 0}
    bar = Progress("encoded", total) if progress else None
    name, fast = fast_encoder(tokenizer, encoder)
    if progress:
        print(f"encoding with {name}", file=sys.stderr)

    def texts():
        for text, size in source.chunks():
            digest.update(text.encode("utf-8", "surrogatepass"))
            counts["text_chars"] += len(text)
            counts["text_bytes"] += size
            yield text

    workers = workers if total > 4 * PIECE_CHARS else 1  # a few pieces: not worth starting processes for
    pieces = cut(texts(), cut_pattern(tokenizer), PIECE_CHARS)
    with path.open("wb") as f:
        for ids in encode_pieces(tokenizer, pieces, workers=workers, fast=fast):
            ids.astype(dtype).tofile(f)
            if bar is not None:
                bar.update(counts["text_bytes"])
    if bar is not None:
        bar.finish()
    return {**counts, "text_sha256": digest.hexdigest()}


def _split(tokens_path: Path, out_dir: Path, n_train: int, itemsize: int) -> None:
    """The token file's first `n_train` ids become train.bin, the rest val.bin: the tail copied out, then the
    file cut short and renamed, so the corpus's ids are never all in memory nor written twice."""

    def write_tail(path: Path) -> None:
        with tokens_path.open("rb") as tokens, path.open("wb") as val:
            tokens.seek(n_train * itemsize)
            shutil.copyfileobj(tokens, val)

    _write_atomically(out_dir / "val.bin", write_tail)
    os.truncate(tokens_path, n_train * itemsize)
    os.replace(tokens_path, out_dir / "train.bin")
