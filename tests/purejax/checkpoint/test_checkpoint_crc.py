"""crc32_combine against zlib.crc32 of the joined bytes (the independent reference)."""

import zlib

import numpy as np
import pytest

from purejax.checkpoint.crc import crc32_combine


@pytest.mark.parametrize("len1,len2", [(0, 0), (0, 7), (7, 0), (1, 1), (3, 64), (1000, 1), (5, 2**20 + 3)])
def test_combining_two_crcs_gives_the_crc_of_the_joined_bytes(len1, len2):
    rng = np.random.default_rng(len1 * 31 + len2)
    a, b = rng.bytes(len1), rng.bytes(len2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len2) == zlib.crc32(a + b)


def test_a_chunk_crc_folds_from_its_pieces_in_order():
    """As restore does: pieces of one record (equal lengths, then a shorter last one) read separately."""
    data = np.random.default_rng(0).bytes(10_000)
    for piece in (1, 7, 4096, 10_000):
        folded = 0
        for begin in range(0, len(data), piece):
            part = data[begin : begin + piece]
            folded = crc32_combine(folded, zlib.crc32(part), len(part))
        assert folded == zlib.crc32(data), piece
