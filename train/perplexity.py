"""The perplexity of a token sequence under a causal language model, scored in sliding windows: Hugging
Face's recipe ("Perplexity of fixed-length models", transformers' docs), what `python -m train.eval` runs.

    windows = plan_windows(len(ids), context=1024, stride=512)
    total_nll, scored = score(logits_fn, params, ids, windows, batch_size=8)
    loss = total_nll / scored                 # nats per token; the perplexity is exp(loss)

A model sees at most `context` tokens, so a long text is cut into windows of that many inputs, each window
moving `stride` tokens on from the last. Input position p predicts token p + 1. A window scores only the
predictions no earlier window made: the first scores all of its own (every token but the text's first), a
later one those past the end of the window before it. So every token but the first is scored exactly once,
and with a stride smaller than the context each window's first scored token still sees `context - stride`
tokens before it (a stride equal to the context gives disjoint windows: fast, but a token just after a
window's start sees little context).

One difference from the guide's code: there a window of `context` tokens is also its targets, shifted inside
the model, so with disjoint windows the first token of every window after the first is never scored. Here a
window's `context` inputs predict the `context` tokens after them, and no token is left out.

The windows are scored `batch_size` at a time; the last, shorter ones are padded (positions and whole
windows) with targets of -1, which `losses.cross_entropy` ignores, so every batch has one shape and the
scoring compiles once. Causal attention means padding after a window's tokens changes none of their logits.
"""

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from purejax import losses

IGNORED = -1  # the target of a position that is padding or was scored by an earlier window
LogitsFn = Callable[[Any, Int[Array, "batch seq"]], Float[Array, "batch seq vocab"]]


class Window(NamedTuple):
    """Input positions [begin, end) of the token ids; those from `first_scored` on are scored here."""

    begin: int
    end: int
    first_scored: int


def plan_windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows over a sequence of `n_tokens` ids: `context` inputs each, starting every `stride` tokens,
    until one reaches the last prediction (input position n_tokens - 2)."""
    if n_tokens < 2:
        raise ValueError(f"a perplexity needs at least 2 tokens (one to predict from, one to score), got {n_tokens}")
    if context < 1:
        raise ValueError(f"the context must be at least 1 token, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(
            f"stride={stride} must be between 1 and the context length {context}: a longer stride would skip tokens"
        )
    predictions = n_tokens - 1  # input positions 0 .. n_tokens - 2, each predicting the token after it
    windows, scored_until = [], 0
    for begin in range(0, predictions, stride):
        end = min(begin + context, predictions)
        windows.append(Window(begin, end, scored_until))
        scored_until = end
        if end == predictions:
            break
    return windows


def batches(
    ids: Int[np.ndarray, " tokens"], windows: list[Window], batch_size: int
) -> Iterator[tuple[Int[np.ndarray, "batch seq"], Int[np.ndarray, "batch seq"]]]:
    """(inputs, targets) of `batch_size` windows at a time, each as long as the longest window; padding and
    positions scored by an earlier window have the target IGNORED (padding inputs are id 0)."""
    length = max(w.end - w.begin for w in windows)
    for start in range(0, len(windows), batch_size):
        inputs = np.zeros((batch_size, length), np.int32)
        targets = np.full((batch_size, length), IGNORED, np.int32)
        for row, window in enumerate(windows[start : start + batch_size]):
            size = window.end - window.begin
            inputs[row, :size] = ids[window.begin : window.end]
            scored = slice(window.first_scored - window.begin, size)
            targets[row, scored] = ids[window.first_scored + 1 : window.end + 1]
        yield inputs, targets


@functools.partial(jax.jit, static_argnums=0)
def batch_nll(
    logits_fn: LogitsFn, params: Any, inputs: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
) -> Float[Array, ""]:
    """The summed negative log-likelihood (nats) of a batch's scored targets, in float32."""
    return losses.cross_entropy(logits_fn(params, inputs), targets, ignore_index=IGNORED).sum()


def score(
    logits_fn: LogitsFn, params: Any, ids: Int[np.ndarray, " tokens"], windows: list[Window], batch_size: int
) -> tuple[float, int]:
    """(the summed negative log-likelihood in nats, the number of tokens scored) of `ids` over `windows`,
    summed in float64 across batches. `logits_fn` must be hashable (a `functools.partial` of a model's
    `apply` with its config is): it is the compiled function's static argument.

    With several local devices the windows are split over them (data parallelism): the params are copied to
    each, every batch's rows are divided among them (`batch_size` rounded up to a multiple of their number),
    and the compiled function's sum over the batch becomes one all-reduce that XLA inserts."""
    devices = jax.local_devices()
    rows = None
    if len(devices) > 1:
        mesh = Mesh(np.array(devices), ("data",))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        rows = NamedSharding(mesh, P("data"))
        batch_size = -(-batch_size // len(devices)) * len(devices)
    total = 0.0
    for inputs, targets in batches(ids, windows, batch_size):
        inputs, targets = jax.device_put((inputs, targets), rows)
        total += float(batch_nll(logits_fn, params, inputs, targets))
    return total, sum(w.end - w.first_scored for w in windows)
