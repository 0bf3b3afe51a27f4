"""Where the text comes from: a user's file or directory, or the built-in corpus every Python carries.

`read_source(path)` names one text file as it is, or every text file under a directory; `stdlib_corpus()`
builds the default corpus, which needs no download. Both return a `Source`: the text (the built-in corpus's in
memory, files' read a chunk at a time by `Source.chunks`, so a corpus larger than memory can be prepared) and a
description of where it came from, which `prepare` records in `meta.json`.

Reading is exact: files are decoded as strict UTF-8 from their bytes (no newline translation), so the
prepared tokens decode back to the very bytes on disk.
"""

import codecs
import importlib.util
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# Files joined into one corpus are separated by a blank line, so one document never runs into the next
# mid-line. A single file is used as it is.
SEPARATOR = "\n\n"

# The extensions read from a directory (compared lower-case). Files with other extensions or none, and
# anything under a hidden ('.'-prefixed) file or folder, such as .git, are skipped. A file named directly
# is always read, whatever its extension.
TEXT_EXTENSIONS = (
    ".txt",
    ".text",
    ".md",
    ".rst",
    ".org",
    ".tex",
    ".csv",
    ".tsv",
    ".json",
    ".jsonl",
    ".yaml",
    ".yml",
    ".toml",
    ".ini",
    ".cfg",
    ".html",
    ".htm",
    ".xml",
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".java",
    ".js",
    ".ts",
    ".go",
    ".rs",
    ".sh",
)

# The standard-library modules whose source completes the default corpus, after `pydoc_data.topics`.
# Chosen to exist, as plain source files, in every CPython from 3.8 to 3.13 at least, and to be nearly
# all ASCII (shlex, with a table of Latin-1 letters, is left out to keep the character vocabulary small).
# Never change this list casually: it defines the default dataset.
STDLIB_MODULES = (
    "argparse",
    "bisect",
    "collections",
    "contextlib",
    "copy",
    "dataclasses",
    "difflib",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "heapq",
    "json",
    "pprint",
    "queue",
    "random",
    "sched",
    "statistics",
    "string",
    "textwrap",
)


CHUNK_BYTES = 1 << 22  # how much of a file is read and decoded at a time


class Source(NamedTuple):
    """A corpus and where it came from: in memory (`text`), or files on disk read a chunk at a time (`paths`).

    Attributes:
        text: the whole corpus, documents joined with `SEPARATOR`; None when it is read from `paths`.
        description: one line for people, e.g. "directory /home/me/poems (12 files)".
        files: the documents in the order joined (paths relative to a directory, or module names).
        paths: the non-empty files whose text, joined with `SEPARATOR`, is the corpus (when `text` is None).
    """

    text: str | None
    description: str
    files: list[str]
    paths: tuple[Path, ...] = ()

    def size_bytes(self) -> int:
        """The corpus's size in UTF-8 bytes, known before reading it (the progress bar's whole)."""
        if self.text is not None:
            return len(self.text.encode("utf-8", "surrogatepass"))
        return sum(path.stat().st_size for path in self.paths) + len(SEPARATOR) * max(0, len(self.paths) - 1)

    def chunks(self, chunk_bytes: int | None = None) -> Iterator[tuple[str, int]]:
        """The corpus in order, as (text, UTF-8 bytes it stands for) of about `chunk_bytes` (`CHUNK_BYTES`)
        each, so a corpus larger than memory can be read; a file that is not UTF-8 is a ValueError naming it
        and the byte."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        if self.text is not None:
            yield self.text, len(self.text.encode("utf-8", "surrogatepass"))
            return
        for i, path in enumerate(self.paths):
            if i:
                yield SEPARATOR, len(SEPARATOR)
            yield from _read_chunks(path, chunk_bytes)

    def read_text(self) -> str:
        """The whole corpus as one string (a small corpus, or a test)."""
        return "".join(text for text, _ in self.chunks())


def _read_chunks(path: Path, chunk_bytes: int) -> Iterator[tuple[str, int]]:
    """`path`'s text, decoded as strict UTF-8 `chunk_bytes` at a time (a character cut between two reads is
    kept for the next)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while True:
            data = f.read(chunk_bytes)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                byte, found = offset - pending + e.start, e.object[e.start : e.start + 4]
                raise ValueError(
                    f"{path} is not UTF-8 text (byte {byte}: {found!r}); convert it to UTF-8 or leave it out"
                ) from None
            offset += len(data)
            if text:
                yield text, len(text.encode("utf-8"))
            if not data:
                return


def text_files(directory: Path) -> list[Path]:
    """The files under `directory` with a `TEXT_EXTENSIONS` extension, hidden ones skipped, sorted by their
    relative path (as a '/'-separated string, so the order is the same on every system)."""
    found = []
    for root, dirs, files in os.walk(directory):  # does not follow symlinked folders
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, f) for f in files if not f.startswith(".") and f.lower().endswith(TEXT_EXTENSIONS)]
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def read_source(path: str | Path) -> Source:
    """The corpus at `path`: a text file as it is, or the non-empty text files under a directory joined with
    `SEPARATOR`. Raises FileNotFoundError for a missing path and ValueError for a directory without text."""
    path = Path(path)
    if path.is_file():
        return Source(None, f"file {path.resolve()}", [path.name], (path,) if path.stat().st_size else ())
    if path.is_dir():
        files = text_files(path)
        if not files:
            raise ValueError(
                f"no text files under {path}: looked for (case-insensitive) {' '.join(TEXT_EXTENSIONS)}; "
                "name a file directly to use any extension"
            )
        files = [f for f in files if f.stat().st_size]  # an empty file adds no separator
        description = f"directory {path.resolve()} ({len(files)} non-empty text files)"
        return Source(None, description, [f.relative_to(path).as_posix() for f in files], tuple(files))
    raise FileNotFoundError(f"input path {path} does not exist (expected a text file or a directory of them)")


def stdlib_corpus() -> Source:
    """The default corpus: the documentation topics of `pydoc_data.topics` (what `help('with')` shows),
    joined in sorted key order, then the source of each module in `STDLIB_MODULES`.

    About 1.0 to 1.2 million characters (1.07 M on Python 3.11.7; 0.98 M on 3.8, 1.17 M on 3.13) and a
    character vocabulary of about 110. The text differs between Python versions, so `prepare` records the
    version and the text's hash. A module whose source is not installed (some minimal distributions ship
    only bytecode) is skipped, and the skip is recorded in the file list.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError(
            "this Python has no pydoc_data module, which the default corpus is built from; name a text file "
            "or directory instead (python -m train.data --input PATH)"
        ) from None
    parts = [topics[key] for key in sorted(topics)]
    files = ["pydoc_data.topics"]
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        source = spec.loader.get_source(name) if spec is not None and spec.loader is not None else None
        if source is None:
            files.append(f"{name} (skipped: no source installed)")
            continue
        parts.append(source)
        files.append(name)
    modules = sum(1 for f in files[1:] if "skipped" not in f)
    version = platform.python_version()
    description = f"stdlib corpus: pydoc_data.topics + {modules} standard-library modules, Python {version}"
    return Source(SEPARATOR.join(parts), description, files)
