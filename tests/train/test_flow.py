"""`python -m train.flow`, run in-process (the test session's compilation cache then serves every run): a
short run that learns and evaluates, exact resume of a MicroDiT run, the batches, and configurations
rejected before anything compiles."""

import json

import jax
import numpy as np
import pytest

from purejax import checkpoint
from train import flow

TINY = ["--config=flow_tiny", "--progress=false"]
pytestmark = pytest.mark.usefixtures("needs_sklearn")  # every test here reads the 8x8 digits


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_learns_and_evaluates(tmp_path):
    result = flow.main(
        [
            *TINY,
            f"--out_dir={tmp_path / 'run'}",
            "--max_iters=80",
            "--lr_decay_iters=80",
            "--batch_size=128",
            "--eval_guidance=1,2",
        ]
    )
    losses = [r["loss"] for r in metrics(tmp_path / "run") if "loss" in r]
    # the untrained model predicts 0, so the loss starts at E|eps - x|^2, ~1.6 on digits scaled to [-1, 1];
    # recorded after 80 steps of this 2x32 model: ~0.95
    assert losses[0] > 1.2 and losses[-1] < losses[0] - 0.3, losses
    assert set(result) >= {"accuracy_g1", "accuracy_g2", "fd_g1", "fd_g2", "fd_floor"}
    assert result["classifier_test_accuracy"] > 0.95 and 0.05 < result["fd_floor"] < 0.15
    assert (tmp_path / "run" / "samples_000080.png").exists()


def leaves(tree):
    return [
        np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
        for x in jax.tree_util.tree_leaves(tree)
    ]


def test_resume_is_bit_exact_for_microdit_and_keeps_the_architecture(tmp_path, capsys):
    common = [
        *TINY,
        "--max_iters=12",
        "--lr_decay_iters=12",
        "--checkpoint_interval=6",
        "--eval_guidance=",
        "--n_mixer=1",
        "--mask_ratio=0.5",
        "--label_dropout=0.3",
    ]
    flow.main([*common, f"--out_dir={tmp_path / 'straight'}"])
    flow.main([*common, f"--out_dir={tmp_path / 'stopped'}", "--max_iters=6"])
    flow.main([*TINY, f"--out_dir={tmp_path / 'stopped'}", "--init_from=resume", "--max_iters=12"])
    assert "resumed from" in capsys.readouterr().out
    straight, _ = checkpoint.restore(tmp_path / "straight" / "ckpt_00000012.msgpack")
    resumed, info = checkpoint.restore(tmp_path / "stopped" / "ckpt_00000012.msgpack")
    assert info.config["train"]["mask_ratio"] == 0.5  # the resumed run took the saved settings
    for a, b in zip(leaves(straight), leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(SystemExit, match="n_layer: checkpoint has 2, override says 3"):
        flow.main([*TINY, f"--out_dir={tmp_path / 'stopped'}", "--init_from=resume", "--n_layer=3"])


def test_layers_reaches_the_model_and_is_not_a_model_key():
    data = flow.images_lib.load_digits()
    assert flow.FlowSettings(layers="loop").model_config(data).layers == "loop"
    assert "layers" not in flow.MODEL_KEYS  # how the blocks run is not part of the model: a resume may change it


def test_bfloat16_training_keeps_t_in_float32(monkeypatch):
    """The model runs in bfloat16, but t reaches it in float32: bfloat16 would round 1000 * t to steps of 4."""
    import jax.numpy as jnp

    from purejax.precision import Policy

    seen = {}

    def velocity(params, z, t, y, config):
        seen.update(z=z.dtype, t=t.dtype, w=params["patch"]["w"].dtype)
        return z

    monkeypatch.setattr(flow.dit, "velocity", velocity)
    data = flow.images_lib.load_digits()
    cfg = flow.FlowSettings(d_model=32, n_layer=1, n_head=2, dtype="bfloat16")
    model = cfg.model_config(data)
    loss_fn = flow.make_loss_fn(cfg, model, Policy(jnp.float32, "bfloat16", jnp.float32))  # as main() builds it
    params = flow.dit.init(jax.random.key(0), model)
    batch = tuple(jnp.asarray(a) for a in flow.get_batch(data, cfg, 0))
    loss, _ = loss_fn(params, batch, jax.random.key(1))
    assert seen == {"z": jnp.bfloat16, "t": jnp.float32, "w": jnp.bfloat16} and loss.dtype == jnp.float32


def test_batches_are_a_function_of_seed_and_step():
    data = flow.images_lib.load_digits()
    cfg = flow.FlowSettings(batch_size=16)
    x, y = flow.get_batch(data, cfg, 7)
    np.testing.assert_array_equal(x, flow.get_batch(data, cfg, 7)[0])
    assert x.shape == (16, 8, 8, 1) and x.min() >= -1 and x.max() <= 1 and y.dtype == np.int32
    assert not np.array_equal(x, flow.get_batch(data, cfg, 8)[0])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--d_model=30"], "divisible by 4"),
        (["--patch_size=3"], "not divisible by patch_size"),
        (["--mask_ratio=1.0"], "mask_ratio=1: must be >= 0 and < 1"),
        (["--eval_guidance=1,two"], "expected numbers separated by commas"),
        (["--dataset=cifar"], "expected one of ['digits', 'mnist']"),
        (["--no_such_key=1"], "valid keys"),
        (["--init_from=resume"], "has no readable checkpoint"),
    ],
)
def test_impossible_configs_fail_before_compiling(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        flow.main([*TINY, f"--out_dir={tmp_path / 'run'}", *args])
    assert message in str(e.value)
    assert "compiled" not in capsys.readouterr().out
