"""purejax.lora: selection, init, merge/unmerge against numpy float64, B = 0 leaves a GPT bit-identical, only the
adapters train (no base-sized optimizer buffer, no gradient into the base), a bfloat16 base, save/load."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt
from purejax import lora, optim
from purejax import tree as tree_lib

CONFIG = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8, bias=True)
TARGETS = ("blocks.attn.qkv.w", "blocks.mlp.*.w")


@pytest.fixture(scope="module")
def base():
    return jax.jit(gpt.init, static_argnums=1)(jax.random.key(0), CONFIG)


# Jitted, as in a training step (and compiled once rather than op by op).
merge = jax.jit(lora.merge, static_argnums=2)
unmerge = jax.jit(lora.unmerge, static_argnums=2, static_argnames="dtype")


def tokens(seed=0, batch=2):
    return jax.random.randint(jax.random.key(seed), (batch, CONFIG.block_size), 0, CONFIG.vocab_size)


def trained_adapters(base, config, seed=1):
    """Adapters with a non-zero B, as after some training."""
    adapters = lora.init(jax.random.key(seed), base, config)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed + 1), x.shape), adapters)


def test_select_patterns_match_whole_components(base):
    config = lora.LoraConfig(targets=TARGETS)
    assert lora.select(base, config) == ["blocks.attn.qkv.w", "blocks.mlp.fc.w", "blocks.mlp.proj.w"]
    assert lora.matches("blocks.*.w", "blocks.attn.w") and not lora.matches("blocks.*.w", "blocks.attn.qkv.w")


@pytest.mark.parametrize(
    ("targets", "message"),
    [(("blocks.attn.qkv",), "match no param path"), (("blocks.mlp.*.*",), "need weight matrices")],
)
def test_select_errors_name_the_pattern_and_the_paths(base, targets, message):
    with pytest.raises(ValueError, match=message) as e:
        lora.select(base, lora.LoraConfig(targets=targets))
    assert "blocks.mlp" in str(e.value)


def test_config_checks():
    for bad in (dict(targets=()), dict(targets=("w",), rank=0), dict(targets=("w",), alpha=float("nan"))):
        with pytest.raises(ValueError, match="LoraConfig"):
            lora.LoraConfig(**bad)
    assert lora.LoraConfig(targets=("w",), rank=4, alpha=8).scale == 2.0


def test_init_shapes_per_layer_and_loralib_bound(base):
    config = lora.LoraConfig(targets=TARGETS, rank=3)
    adapters = lora.init(jax.random.key(1), base, config)
    qkv = adapters["blocks"]["attn"]["qkv"]["w"]
    assert qkv["a"].shape == (2, 8, 3) and qkv["b"].shape == (2, 3, 24)
    assert qkv["a"].dtype == jnp.float32 and not np.asarray(qkv["b"]).any()
    a = np.asarray(qkv["a"])
    assert np.abs(a).max() <= 1 / np.sqrt(8) and not np.array_equal(a[0], a[1])  # a draw per layer
    assert set(tree_lib.flatten(adapters)) == {f"{p}.{k}" for p in lora.select(base, config) for k in "ab"}
    # A target's adapter depends on its own path only: adding a target changes no other.
    more = lora.init(jax.random.key(1), base, lora.LoraConfig(targets=(*TARGETS, "blocks.attn.proj.w"), rank=3))
    np.testing.assert_array_equal(more["blocks"]["attn"]["qkv"]["w"]["a"], qkv["a"])


def test_zero_b_leaves_the_model_bit_identical(base):
    config = lora.LoraConfig(targets=TARGETS, rank=4, alpha=16)
    adapters = lora.init(jax.random.key(1), base, config)
    idx = tokens()
    expected = jax.jit(gpt.apply, static_argnums=2)(base, idx, CONFIG)
    got = jax.jit(lambda b, a, x: lora.frozen(gpt.apply, b, config)(a, x, CONFIG))(base, adapters, idx)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_merge_matches_float64_and_unmerge_is_within_rounding(base):
    config = lora.LoraConfig(targets=TARGETS, rank=4, alpha=8)
    adapters = trained_adapters(base, config)
    merged = merge(base, adapters, config)
    flat_base, flat_merged = tree_lib.flatten(base), tree_lib.flatten(merged)
    for path, w in flat_base.items():
        if path not in lora.select(base, config):
            np.testing.assert_array_equal(flat_merged[path], w)  # untouched leaves: the base's own values
            continue
        ab = tree_lib.subtree(adapters, path)
        a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
        reference = np.asarray(w, np.float64) + config.scale * (a @ b)
        np.testing.assert_allclose(np.asarray(flat_merged[path]), reference, rtol=1e-6, atol=1e-7)
    back = tree_lib.flatten(unmerge(merged, adapters, config))
    for path, w in flat_base.items():
        w, m = np.asarray(w), np.asarray(flat_merged[path])
        assert np.all(np.abs(back[path] - w) <= np.spacing(np.abs(m))), path  # one ulp of W + d at most
        assert np.all((back[path] == w) | (np.spacing(np.abs(m)) >= np.spacing(np.abs(w)))), path  # exact below
    # With B = 0 the round trip is exact, bit for bit.
    zero = lora.init(jax.random.key(1), base, config)
    again = unmerge(merge(base, zero, config), zero, config)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), again, base)


def test_adapters_that_do_not_fit_are_named(base):
    config = lora.LoraConfig(targets=TARGETS, rank=4)
    adapters = lora.init(jax.random.key(1), base, config)
    with pytest.raises(ValueError, match=r"blocks.attn.qkv.w float32\[2,8,24\].*rank 2 needs A \(2, 8, 2\)"):
        lora.merge(base, adapters, lora.LoraConfig(targets=TARGETS, rank=2))
    with pytest.raises(ValueError, match="no weight 'nope.w'"):
        lora.merge(base, {"nope": {"w": {"a": jnp.ones((8, 4)), "b": jnp.ones((4, 8))}}}, config)


def test_only_adapters_train_and_the_base_gets_no_gradient(base):
    config = lora.LoraConfig(targets=TARGETS, rank=2)
    adapters = lora.init(jax.random.key(1), base, config)
    optimizer = optim.adamw(1e-2)
    state = optim.init_train_state(adapters, optimizer, jax.random.key(2))
    # Optimizer state: AdamW's two moments of the adapters, nothing of the base's size.
    float_bytes = tree_lib.nbytes([x for x in jax.tree.leaves(state.opt_state) if jnp.ndim(x) > 0])
    assert float_bytes == 2 * tree_lib.nbytes(adapters) < tree_lib.nbytes(base) / 2
    base_shapes = {jnp.shape(x) for x in jax.tree.leaves(base)} - {jnp.shape(x) for x in jax.tree.leaves(adapters)}
    assert not base_shapes & {jnp.shape(x) for x in jax.tree.leaves(state)}

    @jax.jit
    def step(state, batch, base):
        loss = lora.frozen(functools.partial(gpt.loss, config=CONFIG), base, config)
        return optim.train_step(state, batch, loss_fn=lambda p, b, k: (loss(p, b), {}), optimizer=optimizer)

    batch = (tokens(3), tokens(4))
    before = jax.tree.map(np.asarray, base)
    for _ in range(3):
        state, metrics = step(state, batch, base)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)  # the base is unchanged
    assert np.asarray(state.params["blocks"]["mlp"]["fc"]["w"]["b"]).any()  # and B has moved
    # Differentiating with respect to the base as well: stop_gradient gives it exactly zero.
    grad_fn = jax.grad(lambda b, a: lora.frozen(gpt.loss, b, config)(a, batch, CONFIG), argnums=(0, 1))
    grads = jax.jit(grad_fn)(base, adapters)
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads[0]))
    assert any(np.asarray(g).any() for g in jax.tree.leaves(grads[1]))


def test_bfloat16_base_with_float32_adapters(base):
    config = lora.LoraConfig(targets=TARGETS, rank=2)
    low = tree_lib.cast_floating(base, jnp.bfloat16)
    adapters = trained_adapters(low, config)
    merged = merge(low, adapters, config)
    assert merged["blocks"]["attn"]["qkv"]["w"].dtype == jnp.float32  # the change is kept in float32
    assert merged["blocks"]["attn"]["proj"]["w"].dtype == jnp.bfloat16  # not adapted: the base's own
    expected = merge(tree_lib.cast_floating(low, jnp.float32), adapters, config)
    np.testing.assert_array_equal(
        np.asarray(merged["blocks"]["mlp"]["fc"]["w"]), np.asarray(expected["blocks"]["mlp"]["fc"]["w"])
    )
    back = unmerge(merged, adapters, config, dtype=jnp.bfloat16)
    assert tree_lib.diff(back, low).ok


def test_save_and_load_adapters_alone(base, tmp_path):
    config = lora.LoraConfig(targets=TARGETS, rank=2, alpha=4)
    adapters = trained_adapters(base, config)
    path = lora.save(tmp_path / "adapters.msgpack", adapters, config, step=7)
    loaded, loaded_config = lora.load(path)
    assert loaded_config == config
    jax.tree.map(np.testing.assert_array_equal, loaded, adapters)
    assert path.stat().st_size < tree_lib.nbytes(base) / 2
    with pytest.raises(ValueError, match="records no LoRA config"):
        from purejax import checkpoint

        lora.load(checkpoint.save(tmp_path / "other.msgpack", {"w": np.ones(2)}))
