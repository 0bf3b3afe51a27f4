"""The pictures a run draws at its end: the loss curve from metrics.jsonl and a grid of sample images, each a
PNG written with matplotlib when it is installed (and skipped with a line saying so when it is not)."""

import math
import os
from pathlib import Path

import numpy as np

from train.kit.metrics import MetricsLog

NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib, or purejax[examples])"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing (`NO_MATPLOTLIB`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_losses(log: MetricsLog, png: str | os.PathLike, title: str = "loss") -> Path | None:
    """Train and val loss against step from the metrics log, as a PNG; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    rows = log.read()
    nan = lambda v: math.nan if v is None else v  # noqa: E731 - a non-finite loss was logged as null
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [r["iter"] for r in rows if "loss" in r]
    ax.plot(steps, [nan(r["loss"]) for r in rows if "loss" in r], label="train (batch)", alpha=0.5)
    for name in ("train_loss", "val_loss"):
        points = [(r["iter"], nan(r[name])) for r in rows if name in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=name.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)


def save_grid(images: np.ndarray, path: Path, title: str) -> Path | None:
    """Images (rows * cols, h, w, 1), row-major, as one PNG grid; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    images = np.pad(images[..., 0], ((0, 0), (1, 1), (1, 1)))  # a blank pixel around each image
    n, h, w = images.shape
    rows = cols = int(np.sqrt(n))
    grid = images[: rows * cols].reshape(rows, cols, h, w).transpose(0, 2, 1, 3).reshape(rows * h, cols * w)
    fig, ax = plt.subplots(figsize=(4, 4.2))
    ax.imshow(grid, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
