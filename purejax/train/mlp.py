"""Train the MLP classifier on scikit-learn's bundled 8x8 digits (no download) and print test accuracy.

    python -m purejax.train.mlp [--epochs 30] [--batch_size 64] [--lr 0.1] [--hidden 128,128] [--seed 0]

Everything is explicit: the data split and every batch order come from the seed, the SGD update is written
out, and the one jitted function is the training step.
"""

import argparse
import time

import jax
import numpy as np

from purejax.models import mlp
from purejax import losses


def load_digits(seed: int, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): 1,797 8x8 images scaled to [0, 1], split by a seeded permutation."""
    from sklearn.datasets import load_digits as sklearn_digits  # examples extra; imported only when used

    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def sgd_step(params, batch, config, lr, key):
    """One step of plain SGD: params - lr * grad(loss)."""
    loss, grads = jax.value_and_grad(mlp.loss)(params, batch, config, key)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=str, default="128,128", help="comma-separated hidden sizes")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x_train, y_train, x_test, y_test = load_digits(args.seed)
    hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    config = mlp.MLPConfig(d_in=x_train.shape[1], hidden=hidden, n_classes=10, dropout=args.dropout)
    key = jax.random.key(args.seed)
    params = mlp.init(jax.random.fold_in(key, 0), config)
    step = jax.jit(sgd_step, static_argnums=2)
    evaluate = jax.jit(lambda p, x, y: losses.accuracy(mlp.apply(p, x, config), y))
    print(f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8; model {config}")

    start = time.perf_counter()
    steps_per_epoch = len(x_train) // args.batch_size
    for epoch in range(args.epochs):
        epoch_key = jax.random.fold_in(jax.random.fold_in(key, 1), epoch)
        order = np.asarray(jax.random.permutation(epoch_key, len(x_train)))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            params, loss = step(params, (x_train[idx], y_train[idx]), config, args.lr, jax.random.fold_in(epoch_key, i))
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            acc = float(evaluate(params, x_test, y_test))
            print(f"epoch {epoch + 1:3d}  train loss {float(loss):.4f}  test accuracy {acc:.2%}")
    print(f"done in {time.perf_counter() - start:.1f} s; test accuracy {acc:.2%}")
    return acc


if __name__ == "__main__":
    main()
