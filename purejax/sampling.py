"""Choosing the next token from a language model's logits: temperature, top-k and top-p (nucleus) filtering,
then a draw. Pure functions of arrays, jittable; a filter sets the logits it removes to -inf.

    next_ids = sample(key, logits, temperature=0.8, top_k=200, top_p=0.95)

The order is the usual one (nanoGPT, Hugging Face): divide by the temperature, keep the top k, then keep the
nucleus of the rest. Temperature 0 is greedy decoding (the arg-max), which every filter keeps.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray


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
    under jit cannot be checked; call this outside jit first (as `purejax.models.gpt_decode.generate` does)."""
    if _is_concrete(temperature) and not float(temperature) >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"sample: temperature must be >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"sample: top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None:
        _check_probability("sample", "top_p", top_p)


def _is_concrete(x) -> bool:
    """True for Python numbers and concrete arrays; values traced under jit cannot be checked."""
    return not isinstance(x, jax.core.Tracer)


def _check_probability(where: str, name: str, p) -> None:
    if _is_concrete(p) and not 0.0 < float(p) <= 1.0:
        raise ValueError(f"{where}: {name} must be in (0, 1], got {p}")
