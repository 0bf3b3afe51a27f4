"""Megatron sequence parallelism for the GPT (purejax/parallel/sequence.py, gpt_parallel with
`MeshAxes(sequence_parallel=True)`). The checks that need several devices run once in sequence_child.py (8
simulated CPU devices); these tests judge its numbers: training steps under sp equal one device (without
dropout) and tensor parallelism without sp (with dropout: the same masks); the compiled program trades each
activation all-reduce for an all-gather and a reduce-scatter moving the same bytes; the activation memory
is lower; and what sp cannot do is refused, naming why. `train.gpt --tp=2 --sp=true` trains as `--tp=2` does."""

from pathlib import Path

import pytest

from purejax.parallel import MeshAxes
from tests.children import child_results
from tests.train.test_gpt import TINY, final_state, finish, run_gpt
from tests.train.test_parallel import assert_same_state, corpus, even_corpus  # noqa: F401 - fixtures
from train.gpt import GPTSettings
from train.kit.settings import ConfigError

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    return child_results(HERE / "sequence_child.py", tmp_path_factory.mktemp("sequence"))


@pytest.mark.parametrize("mesh", ["2x4", "2x4-fsdp"])
def test_an_sgd_step_under_sp_equals_one_device(sp_results, mesh):
    """One sharded SGD(1) step (dp x tp, FSDP too): the loss, the gradients (params - new params) and the new
    params equal one device's to float32 rounding."""
    got = sp_results["equivalence"][f"sgd-{mesh}"]
    assert got["loss_rel_err"] < 1e-6
    assert got["grad_rel_err"] < 1e-5
    assert got["params_rel_err"] < 1e-6


def test_dropout_on_sequence_shards_draws_tensor_parallelisms_masks(sp_results):
    """With dropout 0.1, sp and plain tensor parallelism on the same mesh give the same loss and step: each
    device's slice of every mask is the slice of the whole mask. (One device draws other masks for the
    attention probabilities: tensor parallelism folds each device's index into their key, by design.)"""
    got = sp_results["equivalence"]["sgd-dropout-2x4"]
    assert got["loss_rel_err"] < 1e-6
    assert got["params_rel_err"] < 1e-6
    assert abs(got["loss"] - got["loss_without_dropout"]) > 1e-3  # dropout was on: the loss moved


def test_adamw_steps_with_gradient_accumulation_under_sp(sp_results):
    """3 AdamW steps of 2 accumulated micro-batches on dp=2 x tp=4 with sp: against one device without
    dropout, against tensor parallelism without sp with dropout. Without biases: the key bias's gradient is
    zero in exact arithmetic, and Adam, dividing by the gradient's size, turns its rounding noise into steps
    of up to lr (the SGD steps above have biases)."""
    for name in ("adamw-2x4", "adamw-dropout-2x4"):
        got = sp_results["equivalence"][name]
        assert got["loss_rel_err"] < 1e-6, name
        assert got["params_rel_err"] < 1e-5, name
        assert got["opt_state_rel_err"] < 1e-5, name


def test_each_all_reduce_becomes_an_all_gather_and_a_reduce_scatter(sp_results):
    """Forward on a 1 x 4 mesh: tensor parallelism all-reduces the whole activation (batch x seq x d) once per
    attention, once per MLP and once in the embedding (2L + 1); sp instead all-gathers the sequence 2L + 1
    times (before qkv, before fc, before the head) and reduce-scatters it 2L + 1 times (after the two
    row-parallel projections and the embedding). The backward pass doubles each. The bytes a device sends in a
    ring are the same: an all-reduce of N is a reduce-scatter of N then an all-gather of N. What is left of the
    all-reduces is the cross-entropy's per-token scalars and, under sp, the gradients of the replicated params
    (LayerNorms, row-parallel biases, wpe) that now see only this device's tokens."""
    got = sp_results["collectives"]
    n, big, per_pass = got["tp"], got["activation_elements"], 2 * got["n_layer"] + 1
    replicated = 2 * (4 * 16 + 2 * 16) + 2 * 16 + 16 * 16  # per layer ln_1, ln_2, 2 biases; ln_f; wpe
    for part, passes in (("forward", 1), ("backward", 2)):
        tp, sp = got[f"tp-{part}"], got[f"sp-{part}"]
        assert set(tp) == {"all-reduce@model"}, tp
        assert sp["all-gather@model"] == {"ops": passes * per_pass, "elements": passes * per_pass * big}
        assert sp["reduce-scatter@model"] == {"ops": passes * per_pass, "elements": passes * per_pass * big // n}
        small = tp["all-reduce@model"]["elements"] - passes * per_pass * big  # the cross-entropy's
        assert 0 < small < big
        extra = replicated if part == "backward" else 0
        assert sp["all-reduce@model"]["elements"] == small + extra, part
        sent_tp = 2 * (n - 1) / n * passes * per_pass * big  # ring all-reduce of N: 2 (n-1)/n N per device
        sent_sp = (n - 1) / n * sp["all-gather@model"]["elements"] + (n - 1) * sp["reduce-scatter@model"]["elements"]
        assert sent_sp == sent_tp


@pytest.mark.parametrize("remat", ["none", "block"])
def test_sp_needs_less_activation_memory(sp_results, remat):
    """XLA's compiled memory analysis of loss + gradients, a 256-token sequence on tp=4: the temporaries with
    sp are under 0.85 of plain tensor parallelism's, every activation kept or only each block's input."""
    got = sp_results["memory"]
    assert got[f"{remat}-sp"]["temp_bytes"] < 0.85 * got[f"{remat}-tp"]["temp_bytes"]


def test_errors_name_what_sp_cannot_do(sp_results):
    got = sp_results["errors"]
    assert "a sequence of 6 tokens cannot be split evenly over the 4 devices" in got["uneven"]
    assert "'model': 1}; use a mesh with tp >= 2 or sp=False" in got["no_tp"]
    with pytest.raises(ValueError, match="needs model=<axis name> and no context axis"):
        MeshAxes(data="data", sequence_parallel=True)
    with pytest.raises(ValueError, match="needs model=<axis name> and no context axis"):
        MeshAxes(model="model", context="context", sequence_parallel=True)


def test_train_config_refuses_sp_without_what_it_needs():
    with pytest.raises(ConfigError, match="needs --tp > 1"):
        GPTSettings(sp=True)
    with pytest.raises(ConfigError, match="block_size divisible by tp .* tp=4, block_size=66"):
        GPTSettings(sp=True, tp=4, block_size=66)
    with pytest.raises(ConfigError, match="no --cp or --pp"):
        GPTSettings(sp=True, tp=2, cp=2, block_size=64, dropout=0.0)
    assert GPTSettings(sp=True, tp=2).sp


def test_train_gpt_with_sp_equals_tensor_parallelism(tmp_path, even_corpus):  # noqa: F811
    """`python -m train.gpt --tp=2 --sp=true` with dropout trains to the params and AdamW moments of
    `--tp=2` (the same masks)."""
    common = [
        *TINY,
        f"--dataset={even_corpus}",
        "--max_iters=4",
        "--lr_decay_iters=8",
        "--warmup_iters=2",
        "--eval_interval=4",
        "--eval_iters=1",
        "--log_interval=4",
        "--batch_size=8",
        "--n_head=4",
    ]
    finish(run_gpt([*common, "--out_dir=tp", "--tp=2", "--dropout=0.1"], tmp_path))
    out = finish(run_gpt([*common, "--out_dir=sp", "--tp=2", "--sp=true", "--dropout=0.1"], tmp_path))
    assert "sequence parallel over tp (sp)" in out
    assert_same_state(final_state(tmp_path / "sp", 4), final_state(tmp_path / "tp", 4), "tp=2 --sp, dropout 0.1")
