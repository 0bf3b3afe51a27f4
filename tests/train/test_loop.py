"""The loop every training program shares (`train.kit.loop`) and what runs around it (`train.kit.metrics`, `plots`),
with a stand-in step so that nothing compiles: the cadence of evaluations and saves, the rows of metrics.jsonl
(strict JSON, honest timings, no row twice after a resume), plain lines where there is no terminal, and the
divergence watch. The signals themselves are tests/train/test_signals.py."""

import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from train.kit import loop as loop_lib
from train.kit import metrics, plots, signals

ROOT = Path(__file__).resolve().parents[2]


def fake_step(losses: dict[int, float] | None = None):
    """A step that counts and reports `optim.train_step`'s metrics; the loss of iteration `it` is `losses[it]`
    (default 1 / (it + 1)), and a non-finite one is a skipped step."""

    def step(state, it):
        loss = (losses or {}).get(it, 1.0 / (it + 1))
        metrics = {
            "loss": jnp.float32(loss),
            "grad_norm": jnp.float32(2.0),
            "learning_rate": jnp.float32(1e-3),
            "loss_scale": jnp.float32(2.0**15),
            "skipped": jnp.bool_(not math.isfinite(loss)),
            "accuracy": jnp.float32(0.5),
        }
        return state + 1, metrics

    return step


def make_loop(tmp_path, saves, **kwargs):
    settings = dict(start=0, total=10, log_interval=5, progress=True, max_bad_steps=0)
    save = lambda state, it, reason, **meta: saves.append((it, reason, state, meta)) or tmp_path / f"{it}"  # noqa: E731
    return loop_lib.Loop(tmp_path, signals.StopSignal(), save, **{**settings, **kwargs})


def strict_rows(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_cadence_rows_and_plain_lines_without_a_terminal(tmp_path, capsys):
    saves, due = [], []
    loop = make_loop(tmp_path, saves)
    state = loop.run(0, fake_step(), lambda state, it: due.append(it) or (it == 5 and loop.save(state, it, "eval")))
    assert state == 10 and due == list(range(11))  # before every step and once after the last
    assert [(it, reason) for it, reason, *_ in saves] == [(5, "eval"), (10, "end")]
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [r["iter"] for r in rows] == [5, 10]
    assert rows[1] | {"ms_per_iter": 0} == {
        "iter": 10,
        "loss": pytest.approx(0.1),
        "lr": pytest.approx(1e-3),
        "grad_norm": 2.0,
        "loss_scale": 2.0**15,
        "skipped": 0,
        "ms_per_iter": 0,
        "accuracy": 0.5,
    }
    out = capsys.readouterr().out  # not a terminal: no bar, a plain line every log_interval instead
    assert "compiled and ran the first step" in out and "iter 5: loss 0.2000, lr 1.00e-03, skipped 0" in out
    assert "\r" not in out and "saved" in out


def test_a_resumed_run_at_its_end_does_not_save_again(tmp_path):
    saves = []
    make_loop(tmp_path, saves, start=10, resumed=True).run(10, fake_step())
    make_loop(tmp_path, saves, start=10).run(10, fake_step(), save_at_end=False)
    assert saves == []


def test_a_diverging_run_warns_then_stops_without_saving_and_logs_null(tmp_path, capsys):
    saves = []
    losses = {i: math.nan for i in range(3, 100)}
    loop = make_loop(tmp_path, saves, total=100, log_interval=1, max_bad_steps=20)
    with pytest.raises(SystemExit) as e:
        loop.run(0, fake_step(losses))
    assert "the last 20 steps (to iter 23) had a non-finite loss or gradients" in str(e.value)
    assert "loss scale 32768" in str(e.value) and "nothing saved yet" in str(e.value) and saves == []
    out = capsys.readouterr().out
    assert out.count("warning: the last 10 steps (to iter 13)") == 1 and "the run stops at 20" in out
    rows = strict_rows(tmp_path / "metrics.jsonl")  # a bare NaN would fail here
    assert rows[5]["loss"] is None and rows[5]["skipped"] == 1 and rows[5]["loss_scale"] == 2.0**15


def test_a_signal_in_the_loop_saves_after_the_step_in_flight_and_exits_0(tmp_path):
    saves = []
    loop = make_loop(tmp_path, saves)

    def step(state, it):
        if it == 3:
            loop.stop.requested = True  # as the handler sets it
        return fake_step()(state, it)

    with pytest.raises(SystemExit) as e:
        loop.run(0, step)
    assert e.value.code == 0 and [(it, reason) for it, reason, *_ in saves] == [(4, "signal")]


def test_metrics_log_writes_strict_json(tmp_path):
    log = metrics.MetricsLog(tmp_path / "m.jsonl")
    log.write(iter=1, loss=jnp.float32(jnp.nan), big=math.inf, ok=jnp.int32(3), flag=jnp.bool_(True))
    assert strict_rows(tmp_path / "m.jsonl") == [{"iter": 1, "loss": None, "big": None, "ok": 3, "flag": True}]


def test_a_missing_matplotlib_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    loop = make_loop(tmp_path, [])
    loop.run(0, fake_step())
    assert loop.plot("t") is None
    assert "loss.png skipped: matplotlib is not installed" in capsys.readouterr().out


def test_no_bar_without_a_terminal_or_tqdm(monkeypatch):
    assert metrics.live_bar(10) is None  # pytest's stdout is not a terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    assert metrics.live_bar(10) is None and metrics.live_bar(10, enabled=False) is None


def test_a_row_whose_window_holds_only_the_first_step_has_no_timing(tmp_path):
    """The first step (compilation) is timed on its own line; a row right after it has no steps to time, and
    an empty window once gave a near-zero ms/iter and an impossible MFU."""
    rates = lambda seconds: {"mfu": 0.5 / seconds}  # noqa: E731
    make_loop(tmp_path, [], total=3, log_interval=1, rates=rates).run(0, fake_step())
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert "ms_per_iter" not in rows[0] and "mfu" not in rows[0]
    assert all(r["ms_per_iter"] > 0 and r["mfu"] == pytest.approx(500 / r["ms_per_iter"]) for r in rows[1:])


def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(tmp_path):
    make_loop(tmp_path, [], total=10, log_interval=2).run(0, fake_step())  # killed after iter 10, say
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iter": 11, "lo')  # and while appending a row
    make_loop(tmp_path, [], start=6, total=10, log_interval=2, resumed=True).run(6, fake_step())  # ckpt at 6
    assert [r["iter"] for r in strict_rows(tmp_path / "metrics.jsonl")] == [2, 4, 6, 8, 10]


def test_a_run_that_skipped_every_step_fails_however_few_steps_it_had(tmp_path):
    saves = []
    loop = make_loop(tmp_path, saves, total=3, log_interval=5, max_bad_steps=100)  # fewer than max_bad_steps
    with pytest.raises(SystemExit) as e:
        loop.run(0, fake_step({i: math.inf for i in range(3)}))
    assert "every one of the 3 steps of this run had a non-finite loss" in str(e.value) and saves == []


def test_a_run_with_a_good_step_among_skipped_ones_ends_normally(tmp_path):
    saves = []
    make_loop(tmp_path, saves, total=3, log_interval=5, max_bad_steps=100).run(0, fake_step({0: math.inf}))
    assert [(it, reason) for it, reason, *_ in saves] == [(3, "end")]


def test_the_loop_asks_every_step_whether_the_processes_agree_to_stop(tmp_path):
    asked, saves = [], []
    agree = lambda requested, it: asked.append(it) or it == 4  # noqa: E731 - as the processes' sync point would
    with pytest.raises(SystemExit) as e:
        make_loop(tmp_path, saves, agree=agree).run(0, fake_step())
    assert asked == [1, 2, 3, 4] and e.value.code == 0 and [(it, r) for it, r, *_ in saves] == [(4, "signal")]


def test_a_full_disk_ends_the_run_with_one_line_naming_the_last_good_checkpoint(tmp_path):
    from purejax import checkpoint

    def save(state, it, reason, **meta):
        raise checkpoint.CheckpointWriteError(
            tmp_path / "ckpt_10", 28, needed=2_000, free=100, kept="the last good checkpoint is ckpt_5", last_good="5"
        )

    settings = dict(start=0, total=10, log_interval=5, progress=False, max_bad_steps=0)
    loop = loop_lib.Loop(tmp_path, signals.StopSignal(), save, **settings)
    with pytest.raises(SystemExit) as e:
        loop.run(0, fake_step())
    assert str(e.value) == (
        f"error: cannot write checkpoint {tmp_path / 'ckpt_10'}: the disk is full: it needs 2,000 bytes, 100 are "
        "free; the last good checkpoint is ckpt_5"
    )
