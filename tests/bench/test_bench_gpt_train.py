"""bench/gpt_train.py without timing anything: what MFU is measured against (an accelerator's peak from
train.run's table, tested in tests/train/test_gpu_defaults.py), the GPT-2 124M case it runs on a
GPU (built as shapes only, nothing trained), the runs `--configs` and `--bias` name, which GPTConfig.layers
each purejax contender runs, and every peer's copy of purejax's weights, biases included, checked against
purejax's own step as the bench checks it before timing. The peers whose library is not installed are skipped
(the test venv has no flax, equinox, dm-haiku or torch: the bench extra, `pip install purejax[bench]`);
purejax's scan and loop contenders and the raw JAX peers always run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import gpt_train, gpt_train_cases
from models import gpt
from purejax.precision import Policy
from train import gpt as train_gpt


def test_mfu_is_against_the_accelerator_peak_or_the_best_measured_rate():
    rates = [1e11, 3e11, 2e11]
    assert gpt_train.mfu_peak("gpu", "NVIDIA H100 80GB HBM3", rates)[0] == 989e12
    assert gpt_train.mfu_peak("gpu", "NVIDIA L40S", rates)[0] == 3e11  # an unknown chip: measured
    peak, what = gpt_train.mfu_peak("cpu", "cpu", rates)
    assert peak == 3e11 and "100, 300, 200 GFLOP/s" in what


def test_gpt2_case_is_gpt2_small_and_its_step_traces_in_bfloat16():
    """The gpt2 case is GPT-2 124M (block 1024, GPT-2's vocabulary padded to 50304); its purejax loss traces in
    bfloat16 to a float32 scalar. Shapes only (jax.eval_shape): nothing is computed."""
    case = gpt_train.CASES["gpt2"]
    config = case.model
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size) == (
        12,
        12,
        768,
        1024,
        50304,
    )
    params = jax.eval_shape(lambda key: gpt.init(key, config), jax.random.key(0))
    total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    assert 123e6 < total < 125e6, total  # no biases: 124.3M with the position embeddings
    loss_fn = train_gpt.make_loss_fn(config, Policy(jnp.float32, "bfloat16", jnp.float32))
    batch = (jax.ShapeDtypeStruct((case.batch, config.block_size), jnp.int32),) * 2
    loss, _ = jax.eval_shape(loss_fn, params, batch, None)
    assert loss.shape == () and loss.dtype == jnp.float32


def test_cases_are_each_config_without_and_with_biases():
    runs = gpt_train.cases(["tiny", "small-b16"], "both")
    assert list(runs) == ["tiny", "tiny-bias", "small-b16", "small-b16-bias"]
    assert [case.model.bias for case in runs.values()] == [False, True, False, True]
    assert runs["tiny-bias"] == dataclasses.replace(
        gpt_train.CASES["tiny"], model=dataclasses.replace(gpt_train.CASES["tiny"].model, bias=True)
    )
    assert list(gpt_train.cases(["baby"], "true")) == ["baby-bias"]
    assert list(gpt_train.cases(["baby"], "false")) == ["baby"]
    small, small_b16 = gpt_train.CASES["small"], gpt_train.CASES["small-b16"]
    assert (small.batch, small_b16.batch, small.model == small_b16.model) == (4, 16, True)
    with pytest.raises(ValueError, match="bias must be false, true or both, got 'yes'"):
        gpt_train.cases(["tiny"], "yes")


def test_purejax_contender_runs_the_default_layers_and_the_others_scan_and_loop(monkeypatch):
    """`purejax` leaves GPTConfig.layers at its default (what a user gets), `purejax-scan` and `purejax-loop`
    set it: the config each one hands to make_loss_fn is recorded (the steps are built, not run)."""
    seen = []
    make_loss_fn = train_gpt.make_loss_fn

    def recording(model, policy):
        seen.append(model.layers)
        return make_loss_fn(model, policy)

    monkeypatch.setattr(train_gpt, "make_loss_fn", recording)
    case = gpt_train.CASES["tiny"]
    weights, (x, y) = gpt_train.initial_weights(case.model), gpt_train.case_batch(case)
    for peer in ("purejax", "purejax-scan", "purejax-loop"):
        gpt_train.MAKERS[peer](weights, case.model, x, y)
    default = gpt.GPTConfig.__dataclass_fields__["layers"].default
    assert case.model.layers == default and seen == [default, "scan", "loop"]


TINY_BIAS = gpt_train.cases(["tiny"], "true")["tiny-bias"]


@pytest.fixture(scope="module")
def tiny_bias():
    """The tiny-bias run's weights and batch and purejax's two losses on them (float32), shared by the peers."""
    config = TINY_BIAS.model
    weights, (x, y) = gpt_train.initial_weights(config), gpt_train.case_batch(TINY_BIAS)
    _, reference, _ = gpt_train.first_losses("purejax", weights, config, x, y)
    return weights, x, y, reference


def test_the_perturbed_biases_and_scales_change_the_loss_by_more_than_the_check_allows(tiny_bias):
    """Setting the LayerNorm biases, the linear biases or the LayerNorm scales back to their initial 0 or 1 (what
    a peer that dropped them computes) moves purejax's loss by more than 10x the agreement check's 1e-5."""
    weights, x, y, reference = tiny_bias
    loss_fn = train_gpt.make_loss_fn(TINY_BIAS.model, Policy(jnp.float32, "float32", jnp.float32))
    loss = jax.jit(lambda params: loss_fn(params, (x, y), None)[0])
    np.testing.assert_allclose(float(loss(weights)), reference[0], rtol=1e-6)  # the forward alone: the same loss
    for name, value in (("bias", 0.0), ("b", 0.0), ("scale", 1.0)):
        assert abs(float(loss(reset(weights, name, value))) / reference[0] - 1) > 1e-4, name


def reset(weights, name, value):
    """`weights` with every leaf called `name` filled with `value`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: np.full_like(a, value) if path[-1].key == name else a, weights
    )


PEER_LIBRARY = {
    "nnx": "flax",
    "nnx-tree": "flax",
    "nnx-split": "flax",
    "equinox": "equinox",
    "haiku": "haiku",
    "torch": "torch",
    "torch-compile": "torch",
}


@pytest.mark.parametrize("peer", [p for p in gpt_train.PEERS if p != "purejax"])
def test_every_peer_takes_purejax_step_with_biases(peer, tiny_bias):
    """Each contender, built from the same weights (GPT-2's biases, perturbed off zero), reports purejax's loss
    before and after one AdamW step, within the bench's own tolerance (`check_agreement`, float32)."""
    if peer in PEER_LIBRARY:
        pytest.importorskip(PEER_LIBRARY[peer], reason=f"{peer} needs {PEER_LIBRARY[peer]}: the bench extra")
    weights, x, y, reference = tiny_bias
    _, losses, _ = gpt_train.first_losses(peer, weights, TINY_BIAS.model, x, y)
    gpt_train.check_agreement("tiny-bias", {peer: losses}, reference)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_haiku_peer_starts_from_purejax_weights_and_takes_the_same_step(dtype):
    """The Haiku GPT without biases holds exactly purejax's initial weights and reports purejax's loss before and
    after one AdamW step, in float32 and in bfloat16 (what the bench checks before timing, here at a tiny size)."""
    pytest.importorskip("haiku", reason="dm-haiku is in the bench extra (pip install purejax[bench])")
    config = gpt_train_cases.case_model(2, 2, 32, 16)
    weights = gpt_train.initial_weights(config)
    data = np.random.default_rng(0).integers(0, config.vocab_size, (4, config.block_size + 1), dtype=np.int32)
    x, y = data[:, :-1], data[:, 1:]
    ours, theirs = (make(weights, config, x, y, dtype=dtype) for make in (gpt_train.make_purejax, gpt_train.make_haiku))
    rtol = 1e-6 if dtype == "float32" else 1e-2
    for _ in range(2):
        np.testing.assert_allclose(float(theirs()), float(ours()), rtol=rtol)
