"""Train the MLP classifier on scikit-learn's bundled 8x8 digits (no download) and print test accuracy.

    python -m train.mlp --epochs=30 --batch_size=64 --lr=0.1 --hidden=128,128 --seed=0
    python -m train.mlp --help            # every setting, its default and range

Everything is explicit: the data split and every batch order come from the seed, the SGD update is written
out, and the one jitted function is the training step. It is the smallest program here, so it keeps its own
few-line loop; the others share `train.loop` (checkpoints, signals, metrics.jsonl).
"""

import sys
import time
from dataclasses import dataclass

import jax
import numpy as np

from models import mlp
from purejax import losses
from train import config as config_lib
from train.config import setting
from train.data import images as images_lib


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
        config_lib.check_ranges(self)
        self.hidden_sizes  # noqa: B018 - parses hidden, so a typo fails here

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(h) for h in self.hidden.split(",") if h.strip())
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise config_lib.ConfigError(f"hidden={self.hidden!r}: expected positive widths separated by commas")
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


def sgd_step(params, batch, config, lr, key):
    """One step of plain SGD: params - lr * grad(loss)."""
    loss, grads = jax.value_and_grad(mlp.loss)(params, batch, config, key=key)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss


def main(argv: list[str] | None = None) -> float:
    argv = sys.argv[1:] if argv is None else argv
    cfg = config_lib.command_line(MLPSettings, argv, prog="train.mlp", doc=__doc__)
    try:
        x_train, y_train, x_test, y_test = load_digits(cfg.seed)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(f"error: the 8x8 digits: {e}") from None
    steps_per_epoch = len(x_train) // cfg.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"error: batch_size={cfg.batch_size} exceeds the {len(x_train)} training images")
    config = mlp.MLPConfig(d_in=x_train.shape[1], hidden=cfg.hidden_sizes, n_classes=10, dropout=cfg.dropout)
    key = jax.random.key(cfg.seed)
    params = mlp.init(jax.random.fold_in(key, 0), config)
    step = jax.jit(sgd_step, static_argnums=2)
    evaluate = jax.jit(lambda p, x, y: losses.accuracy(mlp.apply(p, x, config), y))
    print(f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8; model {config}")

    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        epoch_key = jax.random.fold_in(jax.random.fold_in(key, 1), epoch)
        order = np.asarray(jax.random.permutation(epoch_key, len(x_train)))
        for i in range(steps_per_epoch):
            idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            params, loss = step(params, (x_train[idx], y_train[idx]), config, cfg.lr, jax.random.fold_in(epoch_key, i))
        if epoch % 5 == 4 or epoch == cfg.epochs - 1:
            acc = float(evaluate(params, x_test, y_test))
            print(f"epoch {epoch + 1:3d}  train loss {float(loss):.4f}  test accuracy {acc:.2%}")
    print(f"done in {time.perf_counter() - start:.1f} s; test accuracy {acc:.2%}")
    return acc


if __name__ == "__main__":
    main()
