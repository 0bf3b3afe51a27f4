"""bench/first_step.py's machinery, timing nothing it asserts: a start is clocked to the line that says its first
step finished, a peer's scaffolding is subtracted, a process that ends first is an error naming it, and the
table puts each contender against raw JAX."""

import pytest

from bench import first_step


def test_the_raw_peer_trains_one_step_and_its_scaffolding_is_taken_off(tmp_path, monkeypatch):
    seconds = first_step.start_seconds("raw", None, tmp_path)
    assert 0 < seconds < 600

    monkeypatch.setitem(first_step.COMMANDS, "raw", ["-c", "print('scaffolding 1e6'); print('first step done')"])
    assert first_step.start_seconds("raw", None, tmp_path) < 0  # the child's own figure was subtracted


def test_a_start_that_never_steps_is_an_error_with_its_output(tmp_path, monkeypatch):
    monkeypatch.setitem(first_step.COMMANDS, "raw", ["-c", "print('error: no data')"])
    with pytest.raises(RuntimeError, match="raw ended before its first step:\nerror: no data"):
        first_step.start_seconds("raw", None, tmp_path)


def test_the_table_is_relative_to_raw_jax():
    table = first_step.table({"gpt": {"cold": 6.0, "cached": 3.0}, "raw": {"cold": 4.0, "cached": 3.0}})
    assert "| gpt | 6.00 | 1.50x | 3.00 | 1.00x |" in table and "| raw | 4.00 | 1.00x | 3.00 | 1.00x |" in table
