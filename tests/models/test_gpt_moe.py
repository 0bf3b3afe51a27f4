"""The GPT with a mixture of experts in its MLPs (gpt_moe.MoEConfig, models/gpt_moe.py).

The independent reference: experts that are all copies of one dense MLP, each token to 2 of them with gates
that sum to 1 and nothing dropped, compute exactly the dense GPT; the loss adds moe_aux_weight times the
layers' mean load-balancing loss, whose formula tests/purejax/nn/test_moe.py checks. The statistics summed
through the scan (gpt_parallel.loss_and_metrics) equal `gpt_moe.block` run one by one; scan and loop agree;
FLOPs count a token's active experts; `train.gpt` runs with --n_experts and --ep and equals one device; bad
settings are refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt, gpt_flops, gpt_moe, gpt_parallel
from purejax import tree as tree_lib
from purejax.nn import stack
from tests.train.test_gpt import TINY, corpus, final_state, finish, run_gpt  # noqa: F401 - corpus: a fixture
from tests.train.test_parallel import assert_same_state
from train.gpt import GPTSettings
from train.kit.settings import ConfigError

DENSE = gpt.GPTConfig(block_size=8, vocab_size=32, n_layer=3, n_head=2, n_embd=16)
MOE = gpt_moe.MoEConfig(**dataclasses.asdict(DENSE), n_experts=4, capacity_factor=0.0, moe_aux_weight=0.1)


def random_params(config, seed=0):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32), shapes)


def batch(config, seed=1):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.integers(0, config.vocab_size, (3, config.block_size)), jnp.int32) for _ in "ab")


def experts_copying_the_dense_mlp(dense_params):
    """MoE params whose every expert is the dense block's MLP, with a random router."""
    params = random_params(MOE)
    blocks = {k: v for k, v in dense_params["blocks"].items() if k != "mlp"}
    copies = jax.tree.map(lambda a: jnp.repeat(a[:, None], MOE.n_experts, axis=1), dense_params["blocks"]["mlp"])
    blocks["moe"] = {"router": params["blocks"]["moe"]["router"], "experts": copies}
    return {**dense_params, "blocks": blocks}


def test_experts_that_copy_the_dense_mlp_compute_the_dense_gpt_plus_the_weighted_aux_loss():
    dense = random_params(DENSE)
    params, data = experts_copying_the_dense_mlp(dense), batch(DENSE)
    want = gpt.loss(dense, data, DENSE)
    logits = jax.jit(functools.partial(gpt.apply, config=MOE))(params, data[0])
    np.testing.assert_allclose(logits, gpt.apply(dense, data[0], DENSE), rtol=1e-5, atol=1e-5)
    loss, metrics = jax.jit(functools.partial(gpt_parallel.loss_and_metrics, config=MOE))(params, data)
    assert float(metrics["moe_aux"]) > 1.0  # a random router is not perfectly balanced
    np.testing.assert_allclose(loss, want + MOE.moe_aux_weight * metrics["moe_aux"], rtol=1e-6)
    np.testing.assert_allclose(gpt.loss(params, data, MOE), want, rtol=1e-5)  # gpt.loss: the cross-entropy alone
    assert float(metrics["moe_dropped"]) == 0.0


def test_train_gpts_evaluation_reports_the_cross_entropy_alone_and_its_step_the_weighted_sum():
    from train import gpt_steps
    from train.kit.devices import Devices

    dense = random_params(DENSE)
    params, data = experts_copying_the_dense_mlp(dense), batch(DENSE)
    cfg = GPTSettings(
        n_layer=3,
        n_head=2,
        n_embd=16,
        block_size=8,
        n_experts=4,
        max_iters=10,
        lr_decay_iters=10,
        warmup_iters=1,
        dtype="float32",
    )
    _, eval_loss = gpt_steps.compile_step(cfg, MOE, Devices(), None, None)
    np.testing.assert_allclose(eval_loss(params, *data), gpt.loss(dense, data, DENSE), rtol=1e-5)
    loss_fn = gpt_steps.make_loss_fn(MOE, gpt_steps.Policy(jnp.float32, "float32", jnp.float32))
    loss, metrics = loss_fn(params, data, None)
    np.testing.assert_allclose(loss, eval_loss(params, *data) + MOE.moe_aux_weight * metrics["moe_aux"], rtol=1e-5)


def test_the_statistics_through_the_scan_are_the_blocks_one_by_one():
    """With capacity 1.0 (drops), the summed statistics equal each block's, run in a Python loop."""
    config = dataclasses.replace(MOE, capacity_factor=1.0)
    params, (idx, _) = random_params(config), batch(config)
    _, metrics = jax.jit(functools.partial(gpt_parallel.loss_and_metrics, config=config))(params, (idx, idx))
    x = params["wte"]["w"][idx] + params["wpe"]["w"][jnp.arange(idx.shape[1])]
    want = {"aux": 0.0, "dropped": 0.0}
    for layer in stack.unstack(params["blocks"]):
        x, layer_stats = gpt_moe.block(layer, x, config)
        want = {k: want[k] + float(layer_stats[k]) for k in want}
    np.testing.assert_allclose(metrics["moe_aux"] * config.n_layer, want["aux"], rtol=1e-5)
    np.testing.assert_allclose(metrics["moe_dropped"] * config.n_layer, want["dropped"], rtol=1e-5)
    assert want["dropped"] > 0


def test_scan_and_loop_agree_with_dropout_and_drops():
    config = dataclasses.replace(MOE, capacity_factor=1.0, dropout=0.1)
    params, data, key = random_params(config), batch(config), jax.random.key(3)
    losses = [
        jax.jit(
            jax.value_and_grad(functools.partial(gpt_parallel.loss, config=dataclasses.replace(config, layers=mode)))
        )(params, data, key=key)
        for mode in ("scan", "loop")
    ]
    np.testing.assert_allclose(losses[0][0], losses[1][0], rtol=1e-5)
    flat = [tree_lib.flatten(g) for _, g in losses]
    for name in flat[0]:
        np.testing.assert_allclose(flat[0][name], flat[1][name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert float(jnp.abs(losses[0][1]["blocks"]["moe"]["router"]["w"]).max()) > 0  # the router learns


def test_flops_count_a_tokens_active_experts():
    """Each token uses top_k of the experts: the FLOPs are the dense GPT's plus 6 x (the router and
    top_k - 1 more MLPs) per layer."""
    mlp = 2 * DENSE.n_embd * 4 * DENSE.n_embd + 4 * DENSE.n_embd + DENSE.n_embd  # fc, proj and their biases
    extra = DENSE.n_layer * (DENSE.n_embd * MOE.n_experts + (MOE.expert_top_k - 1) * mlp)
    assert gpt_flops.flops_per_token(MOE) == gpt_flops.flops_per_token(DENSE) + 6 * extra


def test_the_params_hold_a_router_and_stacked_experts_in_place_of_the_mlp():
    params = random_params(MOE)
    assert "mlp" not in params["blocks"] and "mlp" in random_params(DENSE)["blocks"]
    assert params["blocks"]["moe"]["router"]["w"].shape == (3, 16, 4)
    assert params["blocks"]["moe"]["experts"]["fc"]["w"].shape == (3, 4, 16, 64)
    assert gpt_moe.no_stats(DENSE) == {}


def test_the_dense_gpt_knows_nothing_of_experts_and_saved_configs_read_back_as_their_class():
    """gpt.py imports no gpt_moe (the config chooses the feed-forward); a checkpoint's config["model"] reads
    back as the class it was saved from, and a dense config saved with the experts' fields at n_experts=0 (as
    checkpoints written before MoEConfig hold) as a GPTConfig."""
    assert not hasattr(gpt, "gpt_moe") and not any(f.name == "n_experts" for f in dataclasses.fields(DENSE))
    assert gpt_moe.gpt_config(dataclasses.asdict(MOE)) == MOE
    assert gpt_moe.gpt_config(dataclasses.asdict(DENSE)) == DENSE
    old = {
        **dataclasses.asdict(DENSE),
        "n_experts": 0,
        "expert_top_k": 2,
        "capacity_factor": 1.25,
        "moe_aux_weight": 0.01,
    }
    assert type(gpt_moe.gpt_config(old)) is gpt.GPTConfig and gpt_moe.gpt_config(old) == DENSE
    with pytest.raises(TypeError, match="a GPT config is a mapping of its fields, got None"):
        gpt_moe.gpt_config(None)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_experts=1), "MoEConfig: n_experts must be an int >= 2 \\(a dense MLP: gpt.GPTConfig\\)"),
        (dict(n_experts=4, expert_top_k=5), "expert_top_k must be an int in \\[1, n_experts=4\\]"),
        (dict(n_experts=4, capacity_factor=-1.0), "capacity_factor must be a number >= 0"),
        (dict(n_experts=4, moe_aux_weight=-0.1), "moe_aux_weight must be a number >= 0"),
    ],
)
def test_bad_moe_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MOE, **changes)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(ep=True, dp=2), "--ep splits the experts over the --dp groups: it needs n_experts > 0"),
        (dict(ep=True, dp=1, n_experts=4), "divisible by dp and adamw, but n_experts=4, dp=1"),
        (dict(ep=True, dp=4, n_experts=6), "n_experts=6, dp=4"),
        (dict(n_experts=4, cp=2, block_size=64), "not with --cp, --sp or --pp"),
    ],
)
def test_bad_training_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        GPTSettings(**settings)


def test_train_gpt_with_experts_over_the_data_axis_equals_one_device(tmp_path, corpus):  # noqa: F811
    """`train.gpt --n_experts=4 --dp=2 --ep=true` with no capacity limit (nothing dropped): the checkpoint
    after 4 steps equals one device's, and the log shows the load-balancing metrics."""
    common = [
        *TINY,
        f"--dataset={corpus}",
        "--max_iters=4",
        "--eval_interval=4",
        "--eval_iters=1",
        "--log_interval=2",
        "--n_experts=4",
        "--capacity_factor=0",
    ]
    finish(run_gpt([*common, "--out_dir=single"], tmp_path))
    out = finish(run_gpt([*common, "--out_dir=ep", "--dp=2", "--ep=true"], tmp_path))
    assert "moe_aux 1.0" in out and "moe_dropped 0.0000" in out, out
    assert_same_state(final_state(tmp_path / "ep", 4), final_state(tmp_path / "single", 4), "dp=2 ep at iter 4")
