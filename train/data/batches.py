"""Language-model batches drawn from a token file: reproducible from (seed, step), gathered in one index.

`get_batch(data, batch_size, block_size, seed, step)` draws `batch_size` random windows of `block_size + 1`
tokens, as nanoGPT does (x is a window's first `block_size` tokens, y the same shifted by one), but with
the randomness a pure function of `(seed, step, stream)` instead of a global generator's history. So step
1234 of a resumed run sees exactly the batch that step 1234 of an uninterrupted run saw, with no generator
state to save in the checkpoint.

The gather is one fancy index, `data[offsets[:, None] + arange(block_size + 1)]`, into the memmap: numpy
reads just those windows, without a Python loop per sample.
"""

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import Int, UInt16

Tokens = UInt16[np.ndarray, " tokens"]
Batch = tuple[Int[np.ndarray, "batch block"], Int[np.ndarray, "batch block"]]


def get_batch(
    data: Tokens, batch_size: int, block_size: int, seed: int, step: int, stream: int = 0, rows: range | None = None
) -> Batch:
    """(x, y), each int32 of shape (batch_size, block_size), with y[:, t] the token after x[:, t].

    Arguments:
        data: the token ids of one split, e.g. `open_dataset(path).train` (a uint16 memmap).
        batch_size, block_size: the batch's shape.
        seed: the run's seed.
        step: the training step; the same (seed, step, stream) always gives the same batch.
        stream: separates independent sequences at the same (seed, step), e.g. 0 for training batches and
            1 and 2 for the batches of a train and a val loss estimate. Non-negative, like seed and step.
        rows: only these rows of the batch (default: all), e.g. the rows one process of a multi-process run
            loads (`purejax.parallel.local_rows`). The draw is the whole batch's, so the rows are the same
            whichever process reads them; only their windows are read from `data`.
    """
    for name, value, least in (
        ("batch_size", batch_size, 1),
        ("block_size", block_size, 1),
        ("seed", seed, 0),
        ("step", step, 0),
        ("stream", stream, 0),
    ):
        if int(value) != value or value < least:
            raise ValueError(f"get_batch: {name} must be an integer >= {least}, got {value!r}")
    if block_size >= len(data):
        raise ValueError(
            f"get_batch: block_size {block_size} needs at least {block_size + 1} tokens (a window plus the "
            f"next token), but the data has only {len(data)}; use a smaller block_size or more text"
        )
    # SeedSequence hashes the whole (seed, step, stream) triple, so neighbouring steps get unrelated draws.
    rng = np.random.default_rng([seed, step, stream])
    offsets = rng.integers(0, len(data) - block_size, size=batch_size)  # last start: len - block_size - 1
    if rows is not None:
        if rows.step != 1 or not 0 <= rows.start <= rows.stop <= batch_size:
            raise ValueError(f"get_batch: rows must be a contiguous range within 0..{batch_size}, got {rows}")
        offsets = offsets[rows.start : rows.stop]
    windows = np.asarray(data[offsets[:, None] + np.arange(block_size + 1)], dtype=np.int32)
    return windows[:, :-1], windows[:, 1:]


def batches(
    data: Tokens,
    batch_size: int,
    block_size: int,
    seed: int,
    start_step: int = 0,
    stream: int = 0,
    rows: range | None = None,
) -> Iterator[Batch]:
    """`get_batch` for steps `start_step`, `start_step + 1`, ... without end: a resumed run passes the step
    it resumes at."""
    for step in itertools.count(start_step):
        yield get_batch(data, batch_size, block_size, seed, step, stream, rows)


def prefetch(
    items: Iterable[Any], size: int = 2, device: jax.Device | None = None, put: Callable[[Any], Any] | None = None
) -> Iterator[Any]:
    """The items of `items`, in order, each already moved to `device` by `jax.device_put`, with `size` of
    them on the way ahead of the one being used.

    No thread is needed: `jax.device_put` and a jitted step both return at once and do their work in the
    background (JAX's asynchronous dispatch). So while the step for batch t runs, the loop body's Python
    draws batch t+size from the memmap and starts its transfer, and the device never waits for the host.
    A thread would add an order to reason about and, on a CPU backend, compete with XLA's own threads for
    the same cores. The overlap holds as long as the loop does not block every step (e.g. `float(loss)`
    at every step; block only at log intervals).

    Arguments:
        items: anything whose items are pytrees of arrays, e.g. `batches(...)`.
        size: how many items to keep in flight, >= 1.
        device: where to put them (default: JAX's default device).
        put: how to put an item instead of `jax.device_put(item, device)`; e.g. the identity for items that are
            already arrays on their devices (a multi-process global batch), to keep them in flight alone.
    """
    if int(size) != size or size < 1:
        raise ValueError(f"prefetch size must be an integer >= 1, got {size!r}")
    iterator = iter(items)
    queue: collections.deque = collections.deque()

    def fill(n: int) -> None:
        for item in itertools.islice(iterator, n):
            queue.append(put(item) if put is not None else jax.device_put(item, device))

    fill(size)
    while queue:
        yield queue.popleft()
        fill(1)
