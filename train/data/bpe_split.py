"""Before any merge: checking the text, cutting out special tokens, splitting into words, and GPT-2's byte alphabet.

A byte-level BPE never merges across a word boundary, so the words decide much of the result. GPT-2 and Llama 3
cut them with a regular expression over Unicode classes: `\\p{L}` (letters), `\\p{N}` (numbers) and `\\s`
(white space). Python's `re` has no `\\p{...}`, so the classes are written out here as explicit code-point ranges,
built once from `unicodedata`: a letter is a character of category Lu, Ll, Lt, Lm or Lo, a number one of Nd, Nl
or No. White space is the Unicode White_Space property (what Oniguruma, the engine under Hugging Face
`tokenizers`, means by `\\s`), not Python's `str.isspace`, which also counts the separators U+001C..U+001F.
"""

import functools
import re
import sys
import unicodedata

# The pre-tokenizer patterns as Hugging Face `tokenizers` and tiktoken spell them: recognised by their exact text.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
PATTERNS = {"gpt2": GPT2_PATTERN, "llama3": LLAMA3_PATTERN}
# Unicode's White_Space property, as ranges of code points.
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)]
WHITE_SPACE += [(0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]


def _class_body(ranges: list[tuple[int, int]]) -> str:
    """The inside of a `re` character class matching the code points of `ranges`, e.g. `\\U00000041-\\U0000005a`."""
    return "".join(f"\\U{low:08x}-\\U{high:08x}" for low, high in ranges)


def _ranges_of(categories: tuple[str, ...]) -> list[tuple[int, int]]:
    """The code points whose `unicodedata.category` is one of `categories`, as sorted (first, last) ranges."""
    ranges: list[tuple[int, int]] = []
    for point in range(sys.maxunicode + 1):
        if unicodedata.category(chr(point)) in categories:
            if ranges and ranges[-1][1] == point - 1:
                ranges[-1] = (ranges[-1][0], point)
            else:
                ranges.append((point, point))
    return ranges


@functools.cache
def word_pattern(name: str) -> re.Pattern:
    """The compiled `re` form of `PATTERNS[name]`, its classes spelled out (built once: about a second)."""
    letter = _class_body(_ranges_of(("Lu", "Ll", "Lt", "Lm", "Lo")))
    number = _class_body(_ranges_of(("Nd", "Nl", "No")))
    space = _class_body(WHITE_SPACE)
    lines = r"\r\n"
    if name == "gpt2":
        pattern = (
            rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
            rf"|[{space}]+(?![^{space}])|[{space}]+"
        )
    elif name == "llama3":
        pattern = (
            rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^{lines}{letter}{number}]?[{letter}]+|[{number}]{{1,3}}"
            rf"| ?[^{space}{letter}{number}]+[{lines}]*|[{space}]*[{lines}]+|[{space}]+(?![^{space}])|[{space}]+"
        )
    else:
        raise ValueError(f"no word pattern named {name!r}; known: {sorted(PATTERNS)}")
    return re.compile(pattern)


def split_words(text: str, name: str) -> list[str]:
    """`text` cut into the words of the pattern `name` ("gpt2" or "llama3"); they join back into `text`."""
    return word_pattern(name).findall(text)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte value to a printable character, so that a byte-level token is a string.

    The printable Latin-1 bytes (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) stand for themselves; the other 68 (controls,
    space, soft hyphen...) take the characters from U+0100 on, in byte order: the space becomes `Ġ` (U+0120)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in kept}
    moved = [byte for byte in range(256) if byte not in table]
    table.update({byte: chr(256 + n) for n, byte in enumerate(moved)})
    return table


def checked_text(text: str | bytes) -> str:
    """`text` as a `str` of valid Unicode: bytes are decoded as strict UTF-8, and a bad byte or a lone surrogate
    raises ValueError naming its offset."""
    if isinstance(text, bytes | bytearray):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the input bytes are not valid UTF-8 at byte offset {e.start} ({e.reason})") from None
    if not isinstance(text, str):
        raise TypeError(f"encode takes str or UTF-8 bytes, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode at position {e.start} ({e.reason})") from None
    return text


def split_special(text: str, specials: frozenset[str]) -> list[tuple[str, bool]]:
    """`text` cut into (piece, is_special) around each occurrence of a string of `specials`: the leftmost first,
    the longest where two start at the same place (what Hugging Face's added-token matcher does)."""
    if not specials or not text:
        return [(text, False)] if text else []
    alternatives = "|".join(re.escape(s) for s in sorted(specials, key=lambda s: (-len(s), s)))
    pieces, start = [], 0
    for match in re.finditer(alternatives, text):
        if match.start() > start:
            pieces.append((text[start : match.start()], False))
        pieces.append((match.group(), True))
        start = match.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces
