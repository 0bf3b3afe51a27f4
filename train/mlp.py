"""Train the MLP classifier on scikit-learn's bundled 8x8 digits (no download) and print test accuracy.

    python -m train.mlp --epochs=30 --batch_size=64 --lr=0.1 --hidden=128,128 --seed=0
    python -m train.mlp --help            # every setting, its default and range

Everything is explicit: the data split and every batch order come from the seed, the SGD update is written
out, and the one jitted function is the training step. It is the smallest program here, so it keeps its own
few-line loop; the others share `train.kit.loop` (checkpoints, signals, metrics.jsonl).
"""

import sys
import time
from dataclasses import dataclass

import jax
import numpy as np

from models import mlp
from purejax import losses
from train.data import images as images_lib
from train.kit import settings as settings_lib
from train.kit.settings import setting


@dataclass(frozen=True)
class MLPSettings:
    """Every setting of `python -m train.mlp`."""

    epochs: int = setting(30, "passes over the training images", at_least=1)
    batch_size: int = setting(64, "images per SGD step", at_least=1)
    lr: float = setting(0.1, "the SGD learning rate", above=0)
    hidden: str = setting("128,128", "the hidden layers' widths, comma-separated")
    dropout: float = setting(0.1, "dropout rate after each hidden layer while training", at_least=0, below=1)
    seed: int = setting(0, "the seed of the split, the init, the batch order and dropout", at_least=0, below=2**32)

    def __post_init__(self):
        settings_lib.check_ranges(self)
        self.hidden_sizes  # noqa: B018 - parses hidden, so a typo fails here

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(h) for h in self.hidden.split(",") if h.strip())
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise settings_lib.ConfigError(f"hidden={self.hidden!r}: expected positive widths separated by commas")
        return sizes


def load_digits(seed: int, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): 1,797 8x8 images flattened to 64 values in [0, 1], split by a
    seeded permutation. Read from scikit-learn's installed data file, without importing scikit-learn."""
    images, labels = images_lib.read_digits()
    x = images.reshape(len(images), -1)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], labels[train], x[test], labels[test]


def sgd_step(params, batch, model_config, lr, key):
    """One step of plain SGD: params - lr * grad(loss)."""
    loss, grads = jax.value_and_grad(mlp.loss)(params, batch, model_config, key=key)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss


def main(argv: list[str] | None = None) -> float:
    argv = sys.argv[1:] if argv is None else argv
    settings = settings_lib.command_line(MLPSettings, argv, prog="train.mlp", doc=__doc__)
    try:
        data = load_digits(settings.seed)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(f"error: the 8x8 digits: {e}") from None
    x_train = data[0]
    if len(x_train) < settings.batch_size:
        raise SystemExit(f"error: batch_size={settings.batch_size} exceeds the {len(x_train)} training images")
    model_config = mlp.MLPConfig(
        d_in=x_train.shape[1], hidden=settings.hidden_sizes, n_classes=10, dropout=settings.dropout
    )
    print(f"digits: {len(x_train)} train / {len(data[2])} test images of 8x8; model {model_config}")
    return train(settings, model_config, data)


def train(settings: MLPSettings, model_config: mlp.MLPConfig, data: tuple) -> float:
    """`epochs` of SGD over seeded permutations of the training images, the test accuracy every fifth epoch
    and at the end; returns the last."""
    x_train, y_train, x_test, y_test = data
    steps_per_epoch = len(x_train) // settings.batch_size
    key = jax.random.key(settings.seed)
    params = mlp.init(jax.random.fold_in(key, 0), model_config)
    step = jax.jit(sgd_step, static_argnums=2)
    evaluate = jax.jit(lambda p, x, y: losses.accuracy(mlp.apply(p, x, model_config), y))
    start = time.perf_counter()
    for epoch in range(settings.epochs):
        epoch_key = jax.random.fold_in(jax.random.fold_in(key, 1), epoch)
        order = np.asarray(jax.random.permutation(epoch_key, len(x_train)))
        for i in range(steps_per_epoch):
            idx = order[i * settings.batch_size : (i + 1) * settings.batch_size]
            batch, step_key = (x_train[idx], y_train[idx]), jax.random.fold_in(epoch_key, i)
            params, loss = step(params, batch, model_config, settings.lr, step_key)
        if epoch % 5 == 4 or epoch == settings.epochs - 1:
            accuracy = float(evaluate(params, x_test, y_test))
            print(f"epoch {epoch + 1:3d}  train loss {float(loss):.4f}  test accuracy {accuracy:.2%}")
    print(f"done in {time.perf_counter() - start:.1f} s; test accuracy {accuracy:.2%}")
    return accuracy


if __name__ == "__main__":
    main()
