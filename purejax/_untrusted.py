"""What every reader of a file purejax did not write does the same way: open it only if it is a regular file,
decode JSON at a cost bounded by its length, and quote what it refuses at a bounded cost.

A path may name a FIFO (opening one for reading waits for a writer: for ever), a directory or a device (a
tape rewinds when opened); so the path is checked with `stat` before it is opened, and the open file with
`fstat` after, in case the path changed in between. A hostile header may hold a list of millions of items
or a string of 100 MB, so an error message quotes a cut-down form of it, built without visiting the rest.

JSON from such a file is scanned before it is decoded, at numpy's speed: how deep it nests and how many
arrays and objects it opens are held to the caller's limits, so that decoding neither recurses without
bound nor builds Python objects many times the size of the text (`[],` is 3 bytes; an empty list, 56).
"""

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

# Opening never blocks (a FIFO without a writer) nor makes a terminal the process's controlling terminal.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)


def open_regular(path: Path, error: Callable[[str], Exception]) -> BinaryIO:
    """`path` opened for reading (binary, buffered) if it is a regular file. Otherwise `error(problem)` is raised,
    the problem saying what the path is (a directory, a FIFO, a device or socket); so is any OSError but a
    missing file, which stays FileNotFoundError."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):  # anything else is refused before it is opened: opening may block or act
            fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise error(f"cannot be opened: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(mode):
        raise error(_not_regular(mode))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # the path was replaced between the two checks
        os.close(fd)
        raise error(_not_regular(mode))
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return open(fd, "rb")


def _not_regular(mode: int) -> str:
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
    return f"not a regular file: it is {kind}"


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to about `limit` characters, at a cost that depends on `limit`, not on the size of
    `value`: at most `limit` items of a list or dict are visited, and as many levels deep."""
    if isinstance(value, str):
        text = repr(value[:limit])
    elif isinstance(value, (list, tuple, dict)):
        parts, used = [], 2
        for item in value.items() if isinstance(value, dict) else value:
            if used >= limit:
                parts.append("...")
                break
            pair = isinstance(value, dict)
            parts.append(": ".join(short(v, limit - used) for v in item) if pair else short(item, limit - used))
            used += len(parts[-1]) + 2
        ends = "{}" if isinstance(value, dict) else "()" if isinstance(value, tuple) else "[]"
        text = ends[0] + ", ".join(parts) + ends[1]
    else:  # numbers from a JSON or msgpack decoder: their repr is short (int digits are capped by the reader)
        text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# ---------------------------------------------------------------- JSON

_MAX_INT_CHARS = 21  # "-" and the 20 digits of 2**64 - 1, the largest number the formats read here hold
_CHUNK = 1 << 20  # bytes scanned per step of `json_extent`: its memory, whatever the text's length
_KIND = np.zeros(256, np.int8)  # per byte: 1 opens an array or object, -1 closes one, 2 is a quote
_KIND[[ord("["), ord("{")]], _KIND[[ord("]"), ord("}")]], _KIND[ord('"')] = 1, -1, 2


class HugeInt:
    """A JSON integer longer than any number these formats hold, left unconverted (converting n digits costs
    n**2 time, and Python refuses more than 4,300) so that the check of the entry holding it names the entry."""

    def __init__(self, chars: int):
        self.chars = chars

    def __repr__(self) -> str:
        return f"<an integer of {self.chars:,} characters>"


def _parse_int(text: str) -> int | float | HugeInt:
    if text == "-0":  # a float, as serde_json (the safetensors reference's decoder) reads it: no count is "-0"
        return -0.0
    return int(text) if len(text) <= _MAX_INT_CHARS else HugeInt(len(text))


def _no_constant(name: str) -> None:
    raise ValueError(f"is not JSON: {name} is not a JSON value")


def json_extent(raw: bytes) -> tuple[int, int]:
    """(how many arrays and objects the JSON text `raw` opens, how deep they nest), counted outside strings,
    a megabyte at a time at numpy's speed. Exact for valid JSON; for invalid JSON, exact up to the first error,
    which is as far as a decoder gets. With the escaped backslashes, then the escaped quotes, taken out
    (JSON's escapes pair from the left), every quote left opens or closes a string."""
    bare = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    inside = level = deepest = opened = 0
    for start in range(0, bare.size, _CHUNK):
        kinds = _KIND[bare[start : start + _CHUNK]]
        kinds = kinds[kinds != 0]  # the quotes and brackets, in order
        if kinds.size == 0:
            continue
        quote = kinds == 2
        parity = (np.cumsum(quote, dtype=np.int32) + inside) & 1  # 1 from an opening quote to its closing one
        step = np.where(quote | (parity == 1), 0, kinds)  # the brackets outside strings
        levels = np.cumsum(step, dtype=np.int32) + level
        deepest, level, inside = max(deepest, int(levels.max())), int(levels[-1]), int(parity[-1])
        opened += int(np.count_nonzero(step == 1))
    return opened, deepest


def decode_json(raw: bytes, *, max_depth: int, max_containers: int, pairs_hook: Callable[[list], Any]) -> Any:
    """`raw` decoded as UTF-8 JSON, objects built by `pairs_hook`; or a ValueError whose message says why not
    as the rest of a sentence about the text ("nests 1,000 levels deep; at most 16"). Nesting deeper than
    `max_depth`, or more than `max_containers` arrays and objects (each a Python object of 56 bytes or more,
    from as little as 2 bytes of text), is refused before anything is decoded. NaN and Infinity, which are
    not JSON, are refused; an integer longer than 21 characters is left a HugeInt."""
    containers, depth = json_extent(raw)
    if depth > max_depth:
        raise ValueError(f"nests {depth:,} levels deep; at most {max_depth}")
    if containers > max_containers:
        raise ValueError(f"opens {containers:,} arrays and objects in {len(raw):,} bytes; at most {max_containers:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs_hook, parse_int=_parse_int, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not JSON: {e}") from None
    except RecursionError:  # only if the caller is already near the recursion limit: max_depth is checked above
        raise ValueError("nests deeper than Python's recursion limit allows from here") from None
