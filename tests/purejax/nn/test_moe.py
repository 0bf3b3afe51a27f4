"""The mixture-of-experts layer (purejax/nn/moe.py) against a numpy float64 reference written from the papers:
token-choice top-k routing, GShard's queue order and capacity, dropped assignments, the Switch Transformer's
load-balancing loss; gradients by finite differences; errors before compiling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import activations, moe

D, FF, E = 6, 10, 4


def make_params(seed=0):
    """Random params from numpy, the router large enough that tokens disagree on their experts."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: moe.init(k, D, FF, E), jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), jnp.float32), shapes)
    params["router"]["w"] = params["router"]["w"] * 4
    return params


def reference(params, x, top_k, capacity_factor):
    """numpy float64: (y, aux, dropped fraction), the assignments visited in GShard's order (every token's
    first choice, then every token's second), each taking the next free slot of its expert if any."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, D)
    n = len(tokens)
    cap = n if not capacity_factor else min(n, math.ceil(capacity_factor * n * top_k / E))
    logits = tokens @ p["router"]["w"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    used, y, dropped, chose = np.zeros(E, int), np.zeros_like(tokens), 0, np.zeros(E)
    for j in range(top_k):
        for t in range(n):
            e = order[t, j]
            chose[e] += 1
            if used[e] == cap:
                dropped += 1
                continue
            used[e] += 1
            gate = probs[t, e] if top_k == 1 else probs[t, e] / probs[t, order[t]].sum()
            q = jax.tree.map(lambda a, i=e: a[i], p["experts"])
            h = np.tanh(tokens[t] @ q["fc"]["w"] + q["fc"]["b"])
            y[t] += gate * (h @ q["proj"]["w"] + q["proj"]["b"])
    aux = E * np.sum(chose / (n * top_k) * probs.mean(0))  # Fedus et al. 2021, eq. 4
    return y.reshape(np.shape(x)), aux, dropped / (n * top_k)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_matches_the_numpy_reference_with_capacity_and_drops(top_k, capacity_factor):
    params = make_params()
    x = np.random.default_rng(1).standard_normal((3, 7, D))
    run = jax.jit(lambda p, x: moe.apply(p, x, top_k=top_k, capacity_factor=capacity_factor, activation=jnp.tanh))
    y, stats = run(params, jnp.asarray(x, jnp.float32))
    want_y, want_aux, want_dropped = reference(params, x, top_k, capacity_factor)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["aux"], want_aux, rtol=1e-5)
    np.testing.assert_allclose(stats["dropped"], want_dropped, rtol=1e-6)
    if capacity_factor == 0.5:  # the case really drops, and some tokens lose every expert
        assert want_dropped > 0.3
        assert np.any(np.all(np.asarray(y) == 0, axis=-1))


def test_capacity_is_the_ceiling_of_an_even_share_times_the_factor():
    assert moe.capacity(42, 4, 2, 1.25) == math.ceil(1.25 * 42 * 2 / 4) == 27
    assert moe.capacity(42, 4, 1, None) == moe.capacity(42, 4, 1, 0) == 42
    assert moe.capacity(10, 4, 2, 100.0) == 10  # never more slots than tokens


def test_the_aux_loss_is_one_when_balanced_and_n_experts_when_collapsed():
    """Fedus et al.: minimised (1) by uniform routing; a router sending everything to one expert with
    probability ~1 gives n_experts."""
    params = make_params()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((16, D)), jnp.float32)
    uniform = {**params, "router": {"w": jnp.zeros((D, E))}}
    np.testing.assert_allclose(moe.apply(uniform, x, top_k=1, capacity_factor=None)[1]["aux"], 1.0, rtol=1e-6)
    collapsed = {**params, "router": {"w": jnp.zeros((D, E)).at[:, 2].set(1.0)}}
    x_pos = jnp.abs(x) * 100  # logits of expert 2 huge for every token
    _, stats = moe.apply(collapsed, x_pos, top_k=1, capacity_factor=1.0)
    np.testing.assert_allclose(stats["aux"], E, rtol=1e-4)
    np.testing.assert_allclose(stats["dropped"], 1 - 4 / 16)  # expert 2 takes its 4 slots, the rest drop


@pytest.mark.parametrize("top_k", [1, 2])
def test_gradients_match_finite_differences(top_k):
    """d/dparams of sum(y * w) + aux in float64, against central differences along random directions (the
    routing is piecewise constant: the step is small enough not to change any choice)."""
    with jax.enable_x64():
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), make_params())
        x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, D)))
        w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5, D)))

        def f(p):
            y, stats = moe.apply(p, x, top_k=top_k, capacity_factor=0.75, activation=activations.gelu)
            return jnp.sum(y * w) + stats["aux"]

        grads = jax.grad(f)(params)
        rng, eps = np.random.default_rng(5), 1e-6
        for _ in range(3):
            v = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), params)
            plus = f(jax.tree.map(lambda a, b: a + eps * b, params, v))
            minus = f(jax.tree.map(lambda a, b: a - eps * b, params, v))
            directional = sum(jnp.vdot(g, b) for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(v)))
            np.testing.assert_allclose(directional, (plus - minus) / (2 * eps), rtol=1e-6)
        assert float(jnp.abs(grads["router"]["w"]).max()) > 1e-3  # the router learns, top_k=1 too


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=5, capacity_factor=None), "top_k must be an int in \\[1, n_experts=4\\]"),
        (dict(top_k=0, capacity_factor=None), "top_k must be an int"),
        (dict(top_k=1, capacity_factor=-1.0), "capacity_factor must be None or a number >= 0"),
        (dict(top_k=1, capacity_factor=None, expert_axis="data"), "expert_axis 'data' must be one of the token"),
    ],
)
def test_bad_arguments_are_refused_before_compiling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda p, x: moe.apply(p, x, **kwargs)).lower(make_params(), jnp.zeros((2, D)))


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="n_experts must be an int >= 2"):
        moe.init(jax.random.key(0), D, FF, 1)
    with pytest.raises(ValueError, match="router"):
        moe.apply(make_params(), jnp.zeros((2, D + 1)), top_k=1, capacity_factor=None)
