"""purejax.nn.gated_mlp against float64 numpy (SwiGLU and other gates), its tensor-parallel form against the
whole layer, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import random as prandom
from purejax.nn import activations, gated_mlp, initializers

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3, 4)).astype(np.float32)


def numpy_gated(params, x, activation):
    p = {k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in params.items()}
    x = np.asarray(x, np.float64)
    gate, up = x @ p["gate"]["w"] + p["gate"].get("b", 0), x @ p["up"]["w"] + p["up"].get("b", 0)
    return (activation(gate) * up) @ p["down"]["w"] + p["down"].get("b", 0)


def silu(x):
    return x / (1 + np.exp(-x))


def test_init_structure_and_shapes():
    params = gated_mlp.init(jax.random.key(0), 4, 6)
    assert {k: v["w"].shape for k, v in params.items()} == {"gate": (4, 6), "up": (4, 6), "down": (6, 4)}
    assert all(set(v) == {"w"} for v in params.values())  # no biases by default, as Llama
    with_bias = gated_mlp.init(jax.random.key(0), 4, 6, 5, bias=True)
    assert with_bias["down"]["w"].shape == (6, 5) and with_bias["down"]["b"].shape == (5,)


def test_init_uses_named_keys_and_proj_init():
    key = jax.random.key(3)
    params = gated_mlp.init(key, 4, 6, proj_init=initializers.zeros())
    want = initializers.lecun_normal()(prandom.named_keys(key, "up")["up"], (4, 6), jnp.float32)
    np.testing.assert_array_equal(params["up"]["w"], want)
    assert not np.any(params["down"]["w"]) and np.any(params["gate"]["w"])


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_float64_numpy(bias):
    params = gated_mlp.init(jax.random.key(1), 4, 6, bias=bias)
    if bias:
        params = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape) / a.size, params)
    np.testing.assert_allclose(gated_mlp.apply(params, X), numpy_gated(params, X, silu), rtol=1e-5, atol=1e-6)


def test_other_gates_geglu():
    params = gated_mlp.init(jax.random.key(1), 4, 6, 3)
    got = gated_mlp.apply(params, X[0], activation=activations.relu)
    np.testing.assert_allclose(got, numpy_gated(params, X[0], lambda a: np.maximum(a, 0)), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_shards_equal_the_whole_layer():
    """gate and up split by columns, down by rows over 3 'devices' (a vmapped axis standing for a mesh axis):
    one psum gives every device the whole layer's output, and the replicated bias is added once."""
    params = gated_mlp.init(jax.random.key(2), 4, 6, bias=True)
    params = jax.tree.map(lambda a: a + 0.05, params)  # non-zero biases
    shards = {
        "gate": {"w": params["gate"]["w"].reshape(4, 3, 2).transpose(1, 0, 2), "b": params["gate"]["b"].reshape(3, 2)},
        "up": {"w": params["up"]["w"].reshape(4, 3, 2).transpose(1, 0, 2), "b": params["up"]["b"].reshape(3, 2)},
        "down": {"w": params["down"]["w"].reshape(3, 2, 4), "b": jnp.broadcast_to(params["down"]["b"], (3, 4))},
    }
    got = jax.vmap(lambda p: gated_mlp.apply(p, X, axis_name="model"), axis_name="model")(shards)
    for device in got:
        np.testing.assert_allclose(device, gated_mlp.apply(params, X), rtol=1e-5, atol=1e-6)


def test_dropout_only_with_a_key():
    params = gated_mlp.init(jax.random.key(1), 4, 6)
    np.testing.assert_array_equal(gated_mlp.apply(params, X, dropout=0.5), gated_mlp.apply(params, X))
    dropped = gated_mlp.apply(params, X, dropout=0.5, key=jax.random.key(0))
    assert np.any(np.asarray(dropped) == 0)


def test_errors_name_the_path_and_shapes():
    params = gated_mlp.init(jax.random.key(0), 4, 6)
    with pytest.raises(ValueError, match=r"gated_mlp: x has shape \(2, 5\).*params\['gate'\]\['w'\] of shape \(4, 6\)"):
        gated_mlp.apply(params, np.ones((2, 5), np.float32))
    with pytest.raises(KeyError, match=r"gated_mlp: params have missing keys \['up'\]"):
        gated_mlp.apply({"gate": params["gate"], "down": params["down"]}, X)
    with pytest.raises(KeyError, match=r"gated_mlp.down: params have missing keys \['w'\]"):
        gated_mlp.apply({**params, "down": {"kernel": params["down"]["w"]}}, X)
    with pytest.raises(ValueError, match=r"params\['up'\]\['w'\] has shape \(4, 5\) but params\['gate'\]\['w'\]"):
        gated_mlp.apply({**params, "up": {"w": jnp.ones((4, 5))}}, X)
