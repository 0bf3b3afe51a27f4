"""Activation rematerialisation (`purejax.nn.remat`) in the GPT and the DiT: the same loss and gradients as
without it (float32), and less memory for the backward pass by XLA's own account of the compiled program."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import dit, gpt
from purejax.nn import remat

GPT = gpt.GPTConfig(
    block_size=16, vocab_size=40, n_layer=3, n_head=2, n_embd=32, dropout=0.1, bias=False, layers="scan"
)
DIT = dit.DiTConfig(
    input_size=8, patch_size=2, in_channels=1, d_model=32, n_layer=2, n_head=2, n_classes=3, learn_sigma=False
)


@functools.cache  # each baseline is compiled once
def gpt_grads(config: gpt.GPTConfig):
    params = gpt.init(jax.random.key(0), config)
    idx = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    loss = functools.partial(gpt.loss, config=config, key=jax.random.key(2))  # dropout on: the same masks
    return jax.jit(jax.value_and_grad(loss))(params, (idx, jnp.roll(idx, -1, axis=1)))


@functools.cache
def dit_grads(config: dit.DiTConfig):
    params = jax.tree.map(lambda p: p + 0.02, dit.init(jax.random.key(0), config))  # adaLN-Zero: all gates 0
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
    t, y = jnp.array([0.3, 0.7]), jnp.array([0, 3])

    def loss(params):
        return jnp.mean((dit.velocity(params, x, t, y, config) - x) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
    "grads, config, choice",
    [
        (gpt_grads, GPT, "block"),
        (gpt_grads, dataclasses.replace(GPT, layers="loop"), "dots_saveable"),
        (dit_grads, DIT, "block"),
        (dit_grads, dataclasses.replace(DIT, layers="loop"), "nothing_saveable"),
    ],
    ids=["gpt-scan-block", "gpt-loop-dots_saveable", "dit-scan-block", "dit-loop-nothing_saveable"],
)
def test_gpt_and_dit_compute_the_same_numbers_with_remat(grads, config, choice):
    loss, g = grads(config)
    loss_r, g_r = grads(dataclasses.replace(config, remat=choice))
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_r, g)


def temp_bytes(config: gpt.GPTConfig) -> int:
    """The scratch memory XLA plans for one loss-and-gradient call, compiled (never run)."""
    params = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))
    idx = jax.ShapeDtypeStruct((8, config.block_size), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(functools.partial(gpt.loss, config=config))).lower(params, (idx, idx))
    return compiled.compile().memory_analysis().temp_size_in_bytes


def test_block_remat_needs_less_memory_for_the_backward_pass():
    config = gpt.GPTConfig(block_size=32, vocab_size=32, n_layer=2, n_head=2, n_embd=32, bias=False, layers="scan")
    without = temp_bytes(config)
    block = temp_bytes(dataclasses.replace(config, remat="block"))
    assert block < 0.7 * without, (block, without)


def test_remat_choices():
    f = lambda x: jnp.sin(x) * 2  # noqa: E731
    assert remat.wrap(f, "none") is f
    np.testing.assert_allclose(jax.grad(remat.wrap(f, "block"))(0.5), jax.grad(f)(0.5))
    assert set(remat.POLICIES) <= set(dir(jax.checkpoint_policies))
    with pytest.raises(ValueError, match=r"remat='everything'.*'everything_saveable'"):
        remat.check("everything")
    with pytest.raises(ValueError, match="GPTConfig: remat must be one of"):
        gpt.GPTConfig(remat="save_only_these_names")  # a factory of policies: needs names
    with pytest.raises(ValueError, match="remat='blocks'"):
        dit.DiTConfig(remat="blocks")
