"""End to end: the demo program really trains."""

from purejax.train import mlp as train_mlp


def test_train_mlp_learns_digits(capsys):
    accuracy = train_mlp.main(["--epochs", "10", "--seed", "1"])
    assert accuracy > 0.93
    assert "test accuracy" in capsys.readouterr().out
