"""Expert parallelism (purejax/parallel/experts.py, purejax/nn/moe.py with `expert_axis`) on 8 simulated
devices; experts_child.py computes, these tests judge. The layer with its experts split over the data axis
equals the single-device layer applied to each device's tokens (capacity is per device), forward and
gradients, with and without drops; it runs two all_to_alls forward and two more backward. A GPT with experts
trains under sharded_train_step (ep, ep x tp, fsdp x ep, fsdp x ep x tp, and replicated experts under plain
data parallelism) as on one device when nothing is dropped. Unsupported set-ups are refused with errors
that say what to change."""

import re
from pathlib import Path

import pytest

from tests.children import child_results

HERE = Path(__file__).resolve().parent
LAYER_CASES = ["layer-k2-cNone", "layer-k1-c1.0", "layer-k2-c0.5"]
GPT_CASES = ["gpt-dp8-ep", "gpt-dp4-tp2-ep", "gpt-dp8", "gpt-dp4-tp2-fsdp-ep"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return child_results(HERE / "experts_child.py", tmp_path_factory.mktemp("experts"))


@pytest.mark.parametrize("name", LAYER_CASES)
def test_the_expert_parallel_layer_equals_one_device_per_group_of_tokens(results, name):
    got = results[name]
    assert got["y_rel_err"] < 1e-5
    assert got["grads_rel_err"] < 1e-5  # params and input
    assert got["aux_rel_err"] < 1e-5  # the whole batch's load-balancing loss
    assert got["dropped"] == pytest.approx(got["want_dropped"], abs=1e-6)
    assert (got["dropped"] > 0.3) == name.endswith(("c1.0", "c0.5"))  # the capacity cases really drop


@pytest.mark.parametrize("name", LAYER_CASES)
def test_two_all_to_alls_forward_and_two_backward(results, name):
    assert results[name]["forward"]["all-to-all data"] == 2
    assert results[name]["backward"]["all-to-all data"] == 4


@pytest.mark.parametrize("name", GPT_CASES)
def test_a_gpt_with_experts_trains_as_on_one_device(results, name):
    """Three AdamW steps: loss, load-balancing metric and params (2 layers, 8 experts, top-2, no drops)."""
    got = results[name]
    assert got["loss_rel_err"] < 1e-5
    assert got["aux_rel_err"] < 1e-5
    assert got["params_rel_err"] < 2e-5
    assert got["dropped"] == 0


def test_the_experts_are_split_over_the_data_axis_and_move_by_all_to_all(results):
    """With ep each layer's experts are split over "data" and every step runs 4 all_to_alls per layer
    (2 layers); without ep the experts are replicated and nothing but the usual all-reduces runs."""
    assert results["gpt-dp8-ep"]["expert_spec"] == "P(None, 'data', None, None)"
    assert results["gpt-dp4-tp2-ep"]["expert_spec"] == "P(None, 'data', None, 'model')"
    assert results["gpt-dp8"]["expert_spec"] == "P()"
    for name in ("gpt-dp8-ep", "gpt-dp4-tp2-ep"):
        assert results[name]["collectives"]["all-to-all data"] == 4 * 2
    assert not any("all-to-all" in kind for kind in results["gpt-dp8"]["collectives"])


def test_fsdp_x_ep_gathers_every_matrix_but_the_experts(results):
    """Under fsdp x ep the attention matrices are split over "data" at rest and gathered per layer; the
    experts keep their expert-parallel split. FSDP's layer checkpoint recomputes the forward in the backward
    pass, so each layer runs 2 + 2 + 2 all_to_alls (forward, recomputed forward, backward)."""
    got = results["gpt-dp4-tp2-fsdp-ep"]
    assert "'data'" in got["attn_spec"]
    assert got["expert_spec"] == results["gpt-dp4-tp2-ep"]["expert_spec"]
    assert got["collectives"]["all-to-all data"] == 6 * 2
    assert got["collectives"]["all-gather data"] > 0


@pytest.mark.parametrize(
    "name, message",
    [
        ("experts_not_divisible", "n_experts=6 cannot be split over the 8 devices of data axis 'data'"),
        ("ep_without_experts", "the config is a dense GPTConfig; give a gpt_moe.MoEConfig \\(n_experts > 0\\)"),
        ("experts_with_context", "runs under data, tensor and expert parallelism only, not with context"),
    ],
)
def test_unsupported_set_ups_are_refused_with_what_to_change(results, name, message):
    assert results["errors"][name] != "no error"
    assert re.search(message, results["errors"][name])
