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


# ---------------------------------------------------------------- the helpers the models' `generate` share

IDX = jnp.zeros((2, 3), jnp.int32)  # a (batch 2, seq 3) right-padded prompt


def own_checks(function):
    """`function` without the run-time type checker the tests wrap purejax in (tests/conftest.py), which rejects
    some bad arguments by their annotation first: its own checks are what users get."""
    return getattr(function, "__wrapped__", function)


def test_check_lengths_defaults_to_every_column_and_returns_host_int32():
    for lengths, want in [(None, [3, 3]), (np.array([1, 3], np.int64), [1, 3]), (jnp.array([2, 1]), [2, 1])]:
        got = sampling.check_lengths(lengths, IDX, "here")
        assert isinstance(got, np.ndarray) and got.dtype == np.int32, (lengths, type(got), got.dtype)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "lengths, message",
    [
        (np.array([1, 2, 3]), r"here: lengths must be 2 integers, one per row of the prompt, got int64 \(3,\)"),
        (np.array([1.0, 2.0]), r"here: lengths must be 2 integers.*got float64 \(2,\)"),
        (np.array([True, True]), r"here: lengths must be 2 integers.*got bool"),
        (np.array([1, 0]), r"here: lengths\[1\]=0 is outside \[1, 3\]"),
        (np.array([4, 1]), r"here: lengths\[0\]=4 is outside \[1, 3\]"),
    ],
)
def test_check_lengths_names_the_bad_row_or_shape(lengths, message):
    with pytest.raises(ValueError, match=message):
        sampling.check_lengths(lengths, IDX, "here")


def test_check_lengths_under_jit_checks_the_shape_and_passes_the_values():
    """Traced values cannot be range-checked; their shape and dtype still are, at trace time."""
    got = jax.jit(lambda n: sampling.check_lengths(n, IDX, "here"))(jnp.array([3, 1], jnp.int32))
    np.testing.assert_array_equal(got, [3, 1])
    with pytest.raises(ValueError, match="lengths must be 2 integers"):
        jax.jit(lambda n: sampling.check_lengths(n, IDX, "here"))(jnp.array([3], jnp.int32))


def test_check_generate_returns_the_prompt_and_its_lengths():
    prompt = np.array([[5, 6, 0], [7, 8, 9]], np.int32)
    got_prompt, got_lengths = sampling.check_generate(prompt, [2, 3], max_new_tokens=0, temperature=0.0, top_k=2)
    assert isinstance(got_prompt, jax.Array)
    np.testing.assert_array_equal(got_prompt, prompt)
    np.testing.assert_array_equal(got_lengths, [2, 3])
    np.testing.assert_array_equal(sampling.check_generate(prompt, None, max_new_tokens=4)[1], [3, 3])


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        (np.ones((1, 2), np.int32), {"max_new_tokens": -1}, "max_new_tokens must be an int >= 0, got -1"),
        (np.ones((1, 2), np.int32), {"max_new_tokens": True}, "max_new_tokens must be an int >= 0, got True"),
        (np.ones((1, 2), np.int32), {"max_new_tokens": 2.0}, r"max_new_tokens must be an int >= 0, got 2\.0"),
        (np.ones((1, 2), np.int32), {"max_new_tokens": 1, "temperature": -1.0}, "temperature must be >= 0"),
        (np.ones((1, 2), np.int32), {"max_new_tokens": 1, "top_p": 2.0}, r"top_p must be in \(0, 1\]"),
        (np.ones((1, 0), np.int32), {"max_new_tokens": 1}, r"prompt is empty or not 2-D.*shape \(1, 0\)"),
        (np.ones((3,), np.int32), {"max_new_tokens": 1}, r"prompt is empty or not 2-D.*shape \(3,\)"),
        (np.ones((1, 2), np.int32), {"max_new_tokens": 1, "lengths": [3]}, r"generate: lengths\[0\]=3"),
    ],
)
def test_check_generate_names_the_bad_argument(prompt, kwargs, message):
    lengths = kwargs.pop("lengths", None)
    with pytest.raises(ValueError, match=message):
        own_checks(sampling.check_generate)(prompt, lengths, **kwargs)


def test_check_generate_refuses_a_prompt_of_floats():
    """Token ids must be integers: a float prompt was cast to ints without a word (1.7 -> 1), a bool one to 0/1."""
    for prompt in (np.array([[1.7, 2.2]]), np.array([[True, False]])):
        with pytest.raises(TypeError, match="the prompt must hold integer token ids, got (float32|float64|bool)"):
            own_checks(sampling.check_generate)(prompt, None, max_new_tokens=1)


VOCAB, WIDTH = 7, 8
TRACES = []


def next_token(token, count, i):
    """The toy model's greedy next token: one that depends on the last token, the state and the step."""
    return (3 * token + count + 2 * i) % VOCAB


@jax.jit
def toy_generate(prompt, lengths, key, max_new_tokens, temperature, scale, noise):
    """`generate_loop` over a toy model: its logits are scale x one-hot(next_token) + noise[step], its state a
    count of the steps fed. Traced once for every count, temperature and scale (TRACES counts the traces)."""
    TRACES.append(1)
    rows = jnp.arange(prompt.shape[0])

    def prefill(tokens):
        last = tokens[rows, lengths - 1]
        return scale * jax.nn.one_hot(next_token(last, 0, 0), VOCAB) + noise[0], jnp.int32(1)

    def feed(tokens, i, count):
        token = tokens[rows, lengths + i]  # the token the loop has just drawn
        logits = scale * jax.nn.one_hot(next_token(token, count, i), VOCAB) + noise[i + 1]
        return logits, count + 1

    return sampling.generate_loop(
        prefill, feed, prompt, lengths, width=WIDTH, key=key, max_new_tokens=max_new_tokens, temperature=temperature
    )


PROMPT = np.array([[1, 2, 3, 5], [4, 6, 6, 6]], np.int32)  # row 1's last three columns: padding
LENGTHS = np.array([3, 1], np.int32)


def numpy_greedy(prompt, lengths, n):
    """Row b: its prompt, n tokens each next_token of the one before, then zeros."""
    out = np.zeros((len(prompt), WIDTH), np.int64)
    for b, n_real in enumerate(lengths):
        out[b, :n_real] = prompt[b, :n_real]
        token = prompt[b, n_real - 1]
        for step in range(n):
            token = (3 * token + step + 2 * max(step - 1, 0)) % VOCAB
            out[b, n_real + step] = token
    return out


def test_generate_loop_writes_each_rows_draws_after_its_prompt():
    """Greedy over the toy model against the numpy loop, for several counts and one trace: the padding past each
    row's length becomes zeros, new tokens start at lengths[b], the state and step index reach `feed`."""
    TRACES.clear()
    noise = jnp.zeros((WIDTH, 2, VOCAB))
    for n in (1, 2, 4):
        got = toy_generate(PROMPT, LENGTHS, jax.random.key(0), n, 0.0, 100.0, noise)
        np.testing.assert_array_equal(got, numpy_greedy(PROMPT, LENGTHS, n), err_msg=f"max_new_tokens={n}")
    assert len(TRACES) == 1


def test_generate_loop_draws_step_i_with_fold_in_key_i():
    """Temperature 1 on random logits (no one-hot): step i's tokens are jax.random.categorical(fold_in(key, i))
    of that step's logits."""
    noise = np.random.default_rng(2).normal(size=(WIDTH, 2, VOCAB)).astype(np.float32) * 3.0
    key, n = jax.random.key(5), 4
    got = np.asarray(toy_generate(PROMPT, LENGTHS, key, n, 1.0, 0.0, jnp.asarray(noise)))
    for step in range(n):
        want = jax.random.categorical(jax.random.fold_in(key, step), jnp.asarray(noise[step]), axis=-1)
        np.testing.assert_array_equal(got[[0, 1], LENGTHS + step], want, err_msg=f"step {step}")


@pytest.mark.parametrize(
    "width, max_new_tokens, message",
    [
        (WIDTH, 0, "max_new_tokens must be >= 1, got 0"),
        (5, 2, "width=5 cannot hold the prompt's 4 columns and 2 new tokens; it must be at least 6"),
        (4, 1, "width=4 cannot hold the prompt's 4 columns and 1 new tokens"),
    ],
)
def test_generate_loop_refuses_a_count_or_width_that_would_write_out_of_place(width, max_new_tokens, message):
    """Unchecked, a count of 0 wrote over each row's last prompt token and a short width dropped new tokens."""

    def model(*args):
        raise AssertionError("the check must come before the model runs")

    with pytest.raises(ValueError, match=message):
        sampling.generate_loop(
            model,
            model,
            jnp.asarray(PROMPT),
            jnp.asarray(LENGTHS),
            width=width,
            key=jax.random.key(0),
            max_new_tokens=max_new_tokens,
        )


def test_first_columns_cuts_on_the_host_or_under_jit():
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    want = np.arange(12).reshape(3, 4)[:, :2]
    got = sampling.first_columns(tokens, 2)
    assert isinstance(got, jax.Array) and got.dtype == jnp.int32 and got.shape == (3, 2)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jax.jit(sampling.first_columns, static_argnums=1)(tokens, 2), want)
    np.testing.assert_array_equal(sampling.first_columns(tokens, 4), np.arange(12).reshape(3, 4))
