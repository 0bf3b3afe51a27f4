"""Choosing the next token from a language model's logits: temperature, top-k and top-p (nucleus) filtering,
then a draw. Pure functions of arrays, jittable; a filter sets the logits it removes to -inf.

    next_ids = sample(key, logits, temperature=0.8, top_k=200, top_p=0.95)

The order is the usual one (nanoGPT, Hugging Face): divide by the temperature, keep the top k, then keep the
nucleus of the rest. Temperature 0 is greedy decoding (the arg-max), which every filter keeps.

The language models' `generate` (models/gpt_decode.py, llama_decode.py) share what is not their model's:
the argument checks (`check_generate`, `check_lengths`) and the loop that draws a token per row and feeds it
back (`generate_loop`); each brings its own prefill and decoding step.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray


def top_k_filter(logits: Float[Array, "*batch vocab"], k: int) -> Float[Array, "*batch vocab"]:
    """Keep the `k` largest logits of each row, -inf elsewhere. Ties with the k-th largest are kept, as in
    nanoGPT (`logits[logits < v[:, [-1]]] = -inf`), so a row may keep more than k. `k` is static (a shape);
    k >= vocab keeps everything."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k_filter: k must be a positive int, got {k!r}")
    k = min(k, logits.shape[-1])
    kth_largest = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth_largest, -jnp.inf, logits)


def top_p_filter(logits: Float[Array, "*batch vocab"], p: float | Float[ArrayLike, ""]) -> Float[Array, "*batch vocab"]:
    """Keep the nucleus of each row (Holtzman et al. 2020): the fewest most-likely tokens whose probabilities
    sum to at least `p`, -inf elsewhere. The most likely token is always kept; ties with the least likely
    kept token are kept too. `p` in (0, 1] may be traced (it sets no shape)."""
    _check_probability("top_p_filter", "p", p)
    # Least likely first, and each token's tail: its probability plus all less likely ones'. A token is kept
    # when the tokens above it hold less than p, i.e. when its tail exceeds 1 - p. Summing from the small end
    # keeps that exact near p = 1, where a float32 sum from the top reaches 1 early and would drop thousands
    # of tokens of a large vocabulary (p = 1 must keep every token of non-zero probability).
    ascending = jnp.sort(logits, axis=-1)
    tail = jnp.cumsum(jax.nn.softmax(ascending.astype(jnp.float32), axis=-1), axis=-1)
    keep = (tail > 1 - jnp.asarray(p, jnp.float32)) | (jnp.arange(logits.shape[-1]) == logits.shape[-1] - 1)
    cutoff = jnp.min(jnp.where(keep, ascending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def sample(
    key: PRNGKeyArray,
    logits: Float[Array, "*batch vocab"],
    *,
    temperature: float | Float[ArrayLike, ""] = 1.0,
    top_k: int | None = None,
    top_p: float | Float[ArrayLike, ""] | None = None,
) -> Int[Array, "*batch"]:
    """One token id per row: a draw from softmax(filter(logits / temperature)), or the arg-max when the
    temperature is 0. `temperature` and `top_p` may be traced (changing them does not recompile); `top_k`
    is static. Filtering and the draw run in float32 whatever the logits' dtype."""
    check_args(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    temperature = jnp.asarray(temperature, logits.dtype)
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)  # never divide by 0, even in the unused branch
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p is not None:
        scaled = top_p_filter(scaled, top_p)
    drawn = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def check_args(*, temperature=1.0, top_k=None, top_p=None) -> None:
    """Raise ValueError for a negative temperature, a top_k below 1 or a top_p outside (0, 1]. Values traced
    under jit cannot be checked; call this outside jit first (as `models.gpt_decode.generate` does)."""
    if _is_concrete(temperature) and not float(temperature) >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"sample: temperature must be >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"sample: top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None:
        _check_probability("sample", "top_p", top_p)


def check_generate(
    prompt: Integer[ArrayLike, "batch prompt"], lengths: Any, *, max_new_tokens: int, **settings: Any
) -> tuple[Array, Array | np.ndarray]:
    """The checks a `generate` makes before compiling: the sampling `settings` (`check_args`), max_new_tokens an
    int >= 0, a (batch, >= 1) prompt of integer ids and its `lengths` (`check_lengths`). Returns (prompt as an
    array, lengths)."""
    check_args(**settings)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    prompt = jnp.asarray(prompt)
    if not jnp.issubdtype(prompt.dtype, jnp.integer):  # a float prompt would be cut to ints without a word
        raise TypeError(f"generate: the prompt must hold integer token ids, got {prompt.dtype}")
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"generate: the prompt is empty or not 2-D (the prompt has shape {tuple(prompt.shape)}); "
            "give at least one token id per row, shape (batch, >= 1)"
        )
    return prompt, check_lengths(lengths, prompt, "generate")


def check_lengths(lengths: Any, idx: Array, where: str) -> Array | np.ndarray:
    """`lengths`, the real tokens of each row of a right-padded `idx`, as (batch,) int32; all of `idx`'s columns
    when None. A concrete value must lie in [1, seq] and comes back as numpy (an eager jnp op would compile a
    program of its own)."""
    batch, seq = idx.shape
    if lengths is None:
        return np.full((batch,), seq, np.int32)
    if _is_concrete(lengths):
        lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{where}: lengths must be {batch} integers, one per row of the prompt, got "
            f"{lengths.dtype} {tuple(lengths.shape)}"
        )
    if not _is_concrete(lengths):
        return lengths.astype(jnp.int32)
    bad = np.flatnonzero((lengths < 1) | (lengths > seq))
    if bad.size:
        raise ValueError(
            f"{where}: lengths[{bad[0]}]={lengths[bad[0]]} is outside [1, {seq}]: each row holds 1 "
            f"to {seq} (the prompt array's width) real tokens"
        )
    return lengths.astype(np.int32)


def generate_loop(
    prefill: Callable[[Array], tuple[Array, Any]],
    feed: Callable[[Array, Array, Any], tuple[Array, Any]],
    prompt: Integer[Array, "batch prompt"],
    lengths: Int[ArrayLike, " batch"],
    *,
    width: int,
    key: PRNGKeyArray,
    max_new_tokens: int | Int[Array, ""],
    **settings: Any,
) -> Int[Array, "batch width"]:
    """Generation's loop, under jit: row b of the result is its lengths[b] prompt tokens, then max_new_tokens
    tokens drawn by `sample(fold_in(key, i), logits, **settings)` at step i, then zeros; `width` (static) must
    hold prompt.shape[1] + max_new_tokens. max_new_tokens >= 1 may be traced (a `lax.fori_loop` count), so one
    compilation serves every count; a concrete one is checked against `width` (ValueError).

    Arguments:
        prefill: `tokens` (batch, width), the right-padded prompts, -> (the logits (batch, vocab) that follow
            each row's last prompt token, the model's state: its cache).
        feed: (`tokens`, i, state) -> (logits, state): the logits that follow token lengths + i of each row,
            which the loop has just drawn and written into `tokens`.
    """
    (batch, n_prompt), rows = prompt.shape, jnp.arange(prompt.shape[0])
    _check_loop(n_prompt, width, max_new_tokens)
    tokens = jnp.zeros((batch, width), jnp.int32).at[:, :n_prompt].set(prompt.astype(jnp.int32))
    tokens = jnp.where(jnp.arange(width) < lengths[:, None], tokens, 0)

    def draw(tokens, logits, i):  # each row's token lengths + i
        return tokens.at[rows, lengths + i].set(sample(jax.random.fold_in(key, i), logits, **settings))

    def step(i, carry):
        tokens, logits, state = carry
        tokens = draw(tokens, logits, i)
        return (tokens, *feed(tokens, i, state))

    tokens, logits, _ = jax.lax.fori_loop(0, max_new_tokens - 1, step, (tokens, *prefill(tokens)))
    return draw(tokens, logits, max_new_tokens - 1)


def _check_loop(n_prompt: int, width: int, max_new_tokens) -> None:
    """Raise ValueError for a concrete max_new_tokens below 1, or a `width` without room for the prompt and the
    new tokens (at least one when the count is traced): the loop would write into the last prompt token's
    column, or nowhere (a scatter drops what falls past the end), without a word."""
    count = 1  # a traced count: at least one token
    if _is_concrete(max_new_tokens):
        if not int(max_new_tokens) >= 1:
            raise ValueError(f"generate_loop: max_new_tokens must be >= 1, got {max_new_tokens}")
        count = int(max_new_tokens)
    if width < n_prompt + count:
        raise ValueError(
            f"generate_loop: width={width} cannot hold the prompt's {n_prompt} columns and {count} "
            f"new tokens; it must be at least {n_prompt + count}"
        )


def first_columns(tokens: Int[Array, "batch width"], total: int) -> Int[Array, "batch total"]:
    """tokens[:, :total], cut on the host when `tokens` is concrete: an eager slice compiles a program per total."""
    if not _is_concrete(tokens):  # generate itself under jit
        return tokens[:, :total]
    return jax.device_put(np.asarray(tokens)[:, :total])


def _is_concrete(x) -> bool:
    """True for Python numbers and concrete arrays; values traced under jit cannot be checked."""
    return not isinstance(x, jax.core.Tracer)


def _check_probability(where: str, name: str, p) -> None:
    if _is_concrete(p) and not 0.0 < float(p) <= 1.0:
        raise ValueError(f"{where}: {name} must be in (0, 1], got {p}")
