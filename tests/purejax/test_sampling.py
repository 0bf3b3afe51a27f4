"""purejax.sampling against plain numpy: top-k as nanoGPT writes it, top-p as the nucleus definition reads,
and the draw's distribution against the filtered softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import sampling

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(5, 11)).astype(np.float32) * 2.0
LOGITS[1, [2, 5, 7]] = LOGITS[1].max() + 1.0  # a three-way tie at the top
LOGITS[2, [0, 3]] = 0.5  # ties in the middle


def numpy_top_k(logits, k):
    """nanoGPT: v = topk(logits, k); logits[logits < v[:, [-1]]] = -inf."""
    kth = np.sort(logits, axis=-1)[:, ::-1][:, min(k, logits.shape[-1]) - 1 : min(k, logits.shape[-1])]
    return np.where(logits < kth, -np.inf, logits)


def numpy_top_p(logits, p):
    """Per row: the fewest most-likely tokens whose probability reaches p (Holtzman et al. 2020), plus any
    token tied with the least likely kept one; a plain loop in float64."""
    out = np.full_like(logits, -np.inf)
    for row, x in enumerate(logits.astype(np.float64)):
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-x, kind="stable")
        total, kept = 0.0, []
        for j in order:
            kept.append(j)
            total += probs[j]
            if total >= p:
                break
        keep = x >= x[kept].min()
        out[row, keep] = logits[row, keep]
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 11, 50])
def test_top_k_matches_numpy(k):
    np.testing.assert_array_equal(sampling.top_k_filter(jnp.asarray(LOGITS), k), numpy_top_k(LOGITS, k))


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.99, 1.0])
def test_top_p_matches_numpy(p):
    np.testing.assert_array_equal(sampling.top_p_filter(jnp.asarray(LOGITS), p), numpy_top_p(LOGITS, p))


def test_top_p_near_1_keeps_a_large_vocabulary():
    """Summed from the most likely token, the probabilities of 50,304 tokens reach 1 long before the end
    (in float32 by thousands of tokens; even the float64 loop above drops a few dozen), so p = 1 must be
    exact by construction: it keeps every token. p = 0.999 keeps the float64 nucleus."""
    logits = np.random.default_rng(1).normal(size=(2, 50304)).astype(np.float32) * 5.0
    assert np.isfinite(np.asarray(sampling.top_p_filter(jnp.asarray(logits), 1.0))).all()
    got = np.isfinite(np.asarray(sampling.top_p_filter(jnp.asarray(logits), 0.999)))
    want = np.isfinite(numpy_top_p(logits, 0.999))
    assert abs(int(got.sum()) - int(want.sum())) <= 2, (got.sum(), want.sum())  # rounding at the boundary


def test_top_p_may_be_traced():
    filtered = jax.jit(sampling.top_p_filter)(jnp.asarray(LOGITS), jnp.float32(0.5))
    np.testing.assert_array_equal(filtered, numpy_top_p(LOGITS, 0.5))


def test_greedy_is_the_argmax_whatever_the_filters():
    key = jax.random.key(0)
    for kwargs in [{}, {"top_k": 1}, {"top_k": 3, "top_p": 0.2}]:
        ids = sampling.sample(key, jnp.asarray(LOGITS), temperature=0.0, **kwargs)
        np.testing.assert_array_equal(ids, np.argmax(LOGITS, axis=-1))


def test_draws_follow_the_filtered_softmax():
    """20,000 draws from one row against softmax(top_k(top_p(logits / T))) computed in numpy."""
    row = LOGITS[:1]
    temperature, k, p = 0.7, 6, 0.8
    expected = numpy_top_p(numpy_top_k(row / temperature, k), p)[0].astype(np.float64)
    expected = np.exp(expected - expected.max())
    expected /= expected.sum()
    keys = jax.random.split(jax.random.key(1), 20_000)

    def draw_one(key):
        return sampling.sample(key, jnp.asarray(row), temperature=temperature, top_k=k, top_p=p)[0]

    draw = jax.jit(jax.vmap(draw_one))
    counts = np.bincount(np.asarray(draw(keys)), minlength=row.shape[-1]) / len(keys)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected))  # nothing outside the filtered set
    np.testing.assert_allclose(counts, expected, atol=0.015)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": 0}, "top_k must be a positive int"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampling.sample(jax.random.key(0), jnp.asarray(LOGITS), **kwargs)
