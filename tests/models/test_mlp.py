import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import mlp


def numpy_forward(params, x):
    """The same MLP in float64 numpy: relu hidden layers, linear head."""
    h = np.asarray(x, np.float64)
    names = sorted(k for k in params if k.startswith("hidden_"))
    for name in names:
        h = np.maximum(h @ np.asarray(params[name]["w"], np.float64) + np.asarray(params[name]["b"], np.float64), 0)
    return h @ np.asarray(params["head"]["w"], np.float64) + np.asarray(params["head"]["b"], np.float64)


CONFIG = mlp.MLPConfig(d_in=12, hidden=(16, 8), n_classes=5)


def test_forward_matches_numpy():
    params = mlp.init(jax.random.key(0), CONFIG)
    x = np.random.default_rng(0).normal(size=(4, 12)).astype(np.float32)
    out = mlp.apply(params, x, CONFIG)
    chex.assert_shape(out, (4, 5))
    np.testing.assert_allclose(out, numpy_forward(params, x), rtol=1e-5, atol=1e-5)


def test_loss_matches_numpy_cross_entropy():
    params = mlp.init(jax.random.key(1), CONFIG)
    rng = np.random.default_rng(1)
    x, labels = rng.normal(size=(6, 12)).astype(np.float32), rng.integers(0, 5, 6).astype(np.int32)
    logits = numpy_forward(params, x)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    expected = -log_probs[np.arange(6), labels].mean()
    np.testing.assert_allclose(mlp.loss(params, (x, labels), CONFIG), expected, rtol=1e-5)


def test_param_names_are_the_layer_names():
    params = mlp.init(jax.random.key(0), CONFIG)
    assert sorted(params) == ["head", "hidden_0", "hidden_1"]


def test_changing_the_head_keeps_the_hidden_initialisation():
    a = mlp.init(jax.random.key(0), CONFIG)
    b = mlp.init(jax.random.key(0), mlp.MLPConfig(d_in=12, hidden=(16, 8), n_classes=7))
    chex.assert_trees_all_equal(a["hidden_0"], b["hidden_0"])
    chex.assert_trees_all_equal(a["hidden_1"], b["hidden_1"])


def test_no_key_is_deterministic_and_a_key_applies_dropout():
    config = mlp.MLPConfig(d_in=12, hidden=(64,), n_classes=5, dropout=0.5)
    params = mlp.init(jax.random.key(0), config)
    x = jnp.ones((3, 12))
    chex.assert_trees_all_equal(mlp.apply(params, x, config), mlp.apply(params, x, config))
    with_key = mlp.apply(params, x, config, key=jax.random.key(1))
    assert not np.allclose(with_key, mlp.apply(params, x, config))
    chex.assert_trees_all_equal(with_key, mlp.apply(params, x, config, key=jax.random.key(1)))


def test_jit_does_not_retrace():
    params = mlp.init(jax.random.key(0), CONFIG)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def forward(params, x):
        return mlp.apply(params, x, CONFIG)

    for i in range(3):
        forward(params, jnp.full((4, 12), float(i)))


@pytest.mark.parametrize(
    "kwargs", [dict(d_in=0), dict(hidden=(8, -1)), dict(n_classes=1), dict(dropout=1.0), dict(activation="nope")]
)
def test_impossible_configs_are_rejected(kwargs):
    with pytest.raises(ValueError):
        mlp.MLPConfig(**kwargs)


def test_missing_layer_is_named():
    params = mlp.init(jax.random.key(0), CONFIG)
    del params["hidden_1"]
    with pytest.raises(KeyError, match="hidden_1"):
        mlp.apply(params, jnp.ones((2, 12)), CONFIG)
