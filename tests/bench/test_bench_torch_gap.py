"""bench/gpt_torch_gap.py without torch or timing: how a torch.profiler op list is sorted into kinds, and the
arithmetic of the tables (the fraction left, each group's share of the gap), on made-up figures worked out by
hand."""

import collections

import pytest

from bench import gpt_torch_gap

Event = collections.namedtuple("Event", "key self_cpu_time_total cpu_time_total")  # microseconds, as torch's

# Two profiled steps of a made-up torch step; self times in microseconds.
EVENTS = [
    Event("aten::mm", 6000.0, 6000.0),
    Event("aten::addmm", 1000.0, 1000.0),
    Event("aten::linear", 200.0, 7200.0),  # its self time is the matmul's wrapper; its kernels are mm/addmm
    Event("aten::matmul", 100.0, 3000.0),
    Event("aten::_scaled_dot_product_flash_attention_for_cpu", 800.0, 800.0),
    Event("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", 400.0, 1400.0),
    Event("aten::native_layer_norm_backward", 900.0, 900.0),
    Event("aten::sqrt", 500.0, 500.0),  # inside AdamW.step
    Event("aten::lerp_", 300.0, 300.0),  # inside AdamW.step
    Event("Optimizer.step#AdamW.step", 100.0, 900.0),  # inclusive: its own 100 + sqrt 500 + lerp_ 300
    Event("MmBackward0", 50.0, 4000.0),  # an autograd node's own time: not a matmul kernel
]


def test_torch_ops_are_sorted_into_matmul_attention_and_the_rest():
    kinds, rest = gpt_torch_gap.torch_kinds(EVENTS, steps=2, wall_ms=6.0)
    # ms per step = microseconds / 1000 / 2 steps
    assert kinds["matmul"] == pytest.approx((6000 + 1000 + 200 + 100) / 2e3)  # 3.65
    assert kinds["attention"] == pytest.approx((800 + 400) / 2e3)  # 0.6
    assert kinds["rest"] == pytest.approx((900 + 500 + 300 + 100 + 50) / 2e3)  # 0.925
    assert kinds["optimizer"] == pytest.approx(900 / 2e3)  # the inclusive time of AdamW.step
    assert kinds["kernels"] == pytest.approx(sum(e.self_cpu_time_total for e in EVENTS) / 2e3)  # 5.175
    assert kinds["outside"] == pytest.approx(6.0 - 5.175)
    assert kinds["wall"] == 6.0
    assert rest.most_common(2) == [("native_layer_norm_backward", 0.45), ("sqrt", 0.25)]
    assert sum(rest.values()) == pytest.approx(kinds["rest"])


def test_headline_is_the_fraction_of_purejax_time_torch_needs():
    assert gpt_torch_gap.headline(50.0, 40.0) == pytest.approx((0.8, 0.2))
    ratio, left = gpt_torch_gap.headline(2.0, 5.0)  # torch slower: nothing left
    assert (ratio, left) == pytest.approx((2.5, -1.5))


def test_gap_rows_split_the_profiled_gap_by_group():
    busy = {
        "matmul (YNNPACK)": 2.0,
        "matmul (Eigen)": 1.5,
        "layout change": 0.5,
        "elementwise fusion": 1.0,
        "reduction (YNNPACK)": 0.25,
        "wall": 7.0,
        "thunks": 40.0,
    }
    pj = gpt_torch_gap.purejax_kinds(busy)
    assert pj["kernels"] == pytest.approx(5.25) and pj["outside"] == pytest.approx(1.75)
    kinds, rest = gpt_torch_gap.torch_kinds(EVENTS, steps=2, wall_ms=6.0)
    rows = gpt_torch_gap.gap_rows(pj, kinds, rest)
    cells = {row[0]: [float(c.rstrip("%")) for c in row[1:5]] for row in rows}
    # purejax 7.0 ms against torch 6.0 under the profilers: a gap of 1.0 ms; (purejax, torch, difference, share %)
    expected = {
        "matmul kernels": (3.5, 3.65, -0.15, -15),
        "attention kernel": (0.0, 0.6, -0.6, -60),
        "other kernels": (1.75, 0.925, 0.825, 82.5),  # layout + elementwise + reductions; torch's rest
        "outside kernels": (1.75, 0.825, 0.925, 92.5),  # wall minus kernels on each side
        "wall under the profiler": (7.0, 6.0, 1.0, 100),
    }
    for group, (a, b, diff, share) in expected.items():
        assert cells[group][:3] == pytest.approx([a, b, diff], abs=0.051), group  # printed to 0.1 ms
        assert cells[group][3] == pytest.approx(share, abs=0.51), group  # printed to 1%
    # the groups' differences add up to the gap: each side's groups cover its whole profiled wall
    assert sum(cells[g][3] for g in list(expected)[:-1]) == pytest.approx(100, abs=2)  # shares rounded to 1%
    by_group = {row[0]: row for row in rows}
    assert "AdamW.step 0.5 (inclusive)" in by_group["other kernels"][5]
    assert "matmul (Eigen) 1.5" in by_group["matmul kernels"][5]


def test_median_dicts_count_a_missing_kind_as_zero():
    rounds = [{"a": 1.0, "b": 4.0}, {"a": 3.0}, {"a": 2.0, "b": 5.0}]
    assert gpt_torch_gap.median_dicts(rounds) == {"a": 2.0, "b": 4.0}


def test_unknown_config_is_named_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        gpt_torch_gap.main(["--configs", "tiny,huge"])
    assert "unknown config huge; valid: tiny, baby, small, small-b16" in capsys.readouterr().err
