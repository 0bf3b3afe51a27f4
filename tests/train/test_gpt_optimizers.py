"""`--optimizer=adamw|shampoo|muon` in train.gpt (`gpt_config.make_optimizer`): which parameters each part of
the optimizer gets, Shampoo equal to AdamW before its preconditioning starts, Muon's update at the RMS that
`muon_rms` asks for, and the device layouts they refuse. The optimizers' own maths is checked against optax
in tests/purejax/optim/."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import tree as tree_lib
from train import gpt
from train.gpt_settings import GPTSettings
from train.gpt_steps import make_optimizer, new_state

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True, decay_lr=False, learning_rate=1e-3)
MATRICES = {"blocks.attn.qkv.w", "blocks.attn.proj.w", "blocks.mlp.fc.w", "blocks.mlp.proj.w"}


def first_update(cfg: GPTSettings) -> tuple[dict, dict]:
    """(params, the first update) for random gradients, as flat {path: array}."""
    params = new_state(cfg, cfg.model_config(40)).params
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    optimizer = make_optimizer(cfg)
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    return tree_lib.flatten(params), tree_lib.flatten(updates)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    state = new_state(GPTSettings(optimizer="muon", **TINY), GPTSettings(**TINY).model_config(40))
    paths = tree_lib.flatten(state.opt_state)
    muon = {p.removeprefix("muon.mu.") for p in paths if p.startswith("muon.mu.")}
    adam = {p.removeprefix("adam.mu.") for p in paths if p.startswith("adam.mu.")}
    assert muon == MATRICES
    assert {"wte.w", "wpe.w", "ln_f.scale", "blocks.ln_1.scale", "blocks.attn.qkv.b"} <= adam
    assert not adam & muon and adam | muon == set(tree_lib.flatten(state.params))


@pytest.mark.parametrize("rms", [0.2, 0.5])
def test_muon_updates_the_matrices_at_the_rms_asked_for(rms):
    """Each layer's matrix update is -lr * rms * sqrt(max(d_in, d_out)) * NS5(momentum): an RMS of about
    lr * rms, as NS5's singular values lie in [0.68, 1.14] (purejax/optim/muon.py)."""
    _, updates = first_update(GPTSettings(optimizer="muon", muon_rms=rms, weight_decay=0.0, **TINY))
    for path in MATRICES:
        per_layer = np.sqrt(np.mean(np.square(updates[path]), axis=(1, 2)))
        assert np.all((0.6 < per_layer / (1e-3 * rms)) & (per_layer / (1e-3 * rms) < 1.2)), (path, per_layer)


def test_shampoo_is_adamw_until_it_starts_preconditioning():
    """Grafted onto Adam, Shampoo's update before `shampoo_start` is Adam's own: the same AdamW update, decay
    on the same leaves included."""
    _, shampoo = first_update(GPTSettings(optimizer="shampoo", shampoo_start=5, **TINY))
    _, adamw = first_update(GPTSettings(optimizer="adamw", **TINY))
    assert shampoo.keys() == adamw.keys()
    for path in adamw:
        np.testing.assert_allclose(shampoo[path], adamw[path], rtol=1e-6, atol=1e-10, err_msg=path)


def test_shampoo_preconditions_once_started():
    _, shampoo = first_update(GPTSettings(optimizer="shampoo", shampoo_start=0, shampoo_precondition_every=1, **TINY))
    _, adamw = first_update(GPTSettings(optimizer="adamw", **TINY))
    assert not np.allclose(shampoo["blocks.mlp.fc.w"], adamw["blocks.mlp.fc.w"], rtol=1e-3)
    assert jnp.all(jnp.isfinite(shampoo["blocks.mlp.fc.w"]))


@pytest.mark.parametrize("layout", ["--tp=2", "--fsdp=true"])
def test_matrix_optimizers_refuse_sliced_matrices(layout):
    with pytest.raises(SystemExit, match=f"optimizer=muon preconditions whole matrices.*{layout.split('=')[0]}"):
        gpt.parse(["--optimizer=muon", layout])
    with pytest.raises(SystemExit, match=r"--optimizer=lamb: expected one of \['adamw', 'shampoo', 'muon'\]"):
        gpt.parse(["--optimizer=lamb"])
