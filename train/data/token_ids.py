"""What every tokenizer hands out and takes back: a 1-D array of integer token ids, checked on the way in.

Its own file so that each tokenizer module (`tokenizers`, `bpe`) can share it without importing the other.
"""

import numpy as np
from jaxtyping import Int
from numpy.typing import ArrayLike

TokenIds = Int[np.ndarray, " tokens"]


def as_ids(ids: ArrayLike, vocab_size: int) -> np.ndarray:
    """`ids` (a list, numpy or jax array) as a 1-D int64 array, checked to lie in [0, vocab_size)."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"decode takes a 1-D sequence of token ids, got shape {ids.shape}; decode each row")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"decode takes integer token ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"token ids {sorted(set(bad.tolist()))[:10]} are outside the vocabulary [0, {vocab_size})")
    return ids
