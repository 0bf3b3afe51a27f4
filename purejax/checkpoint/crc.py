"""`crc32_combine`: the CRC-32 of two byte strings joined, from the CRC-32 of each and the second's length.

Reading a chunk in pieces on several threads gives one CRC per piece; this joins them into the chunk's CRC
(what the file stores) without a second pass over the data. Python's `zlib` has no `crc32_combine`, so it is
written out here, as zlib's own (since 1.2.12) does it: a CRC is the message as a polynomial over GF(2),
times x^32, modulo the CRC polynomial; appending `n` bytes multiplies the first part by x^(8n). So
`crc(A + B) = crc(A) * x^(8 len B) + crc(B)`, with the power found by repeated squaring. Bits are reflected
(the lowest-order coefficient in the highest bit), as in zlib.
"""

import functools
from collections.abc import Iterable

_POLYNOMIAL = 0xEDB88320  # CRC-32 (ISO-HDLC, zlib's), reflected
_ONE = 1 << 31  # the polynomial 1, reflected


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both reflected."""
    product = 0
    for bit in range(31, -1, -1):
        if a & (1 << bit):
            product ^= b
        b = (b >> 1) ^ _POLYNOMIAL if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=64)  # pieces mostly have one of a few lengths
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the CRC polynomial: square-and-multiply over the bits of 8 * nbytes."""
    result, power, n = _ONE, 1 << 30, 8 * nbytes  # power: x^1, then x^2, x^4, ...
    while n:
        if n & 1:
            result = _multiply(power, result)
        power, n = _multiply(power, power), n >> 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """`zlib.crc32(a + b)` given `crc1 = zlib.crc32(a)`, `crc2 = zlib.crc32(b)` and `len2 = len(b)`."""
    if crc1 == 0:  # a is empty (or checksums to 0): nothing to shift, and an uncached _shift(len2) is not free
        return crc2
    return _multiply(_shift(len2), crc1) ^ crc2


def crc32_of_pieces(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces given as `(length, CRC-32)` pairs, in order."""
    crc = 0
    for length, piece_crc in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc
