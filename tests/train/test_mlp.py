"""End to end: the demo program really trains, with the shared parser; without scikit-learn's data it says so."""

import importlib.util

import pytest

from train import mlp as train_mlp


@pytest.mark.usefixtures("needs_sklearn")
def test_train_mlp_learns_digits(capsys):
    accuracy = train_mlp.main(["--epochs=10", "--seed=1"])
    assert accuracy > 0.93
    assert "test accuracy" in capsys.readouterr().out


def test_without_scikit_learn_a_clear_error(monkeypatch):
    find_spec = importlib.util.find_spec
    hide_sklearn = lambda name, *args: None if name == "sklearn" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hide_sklearn)
    with pytest.raises(SystemExit) as e:
        train_mlp.main(["--epochs=1"])
    assert str(e.value) == (
        "error: the 8x8 digits: the 'sklearn' package is not installed; install it with `pip install scikit-learn`"
    )
