"""A classifier's confusion matrix: counted, as text (per-class accuracy beside it) and as a small PNG; what
`train.classify` prints and draws after its last epoch."""

from pathlib import Path

import numpy as np

from train.kit import plots


def matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted]."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (labels, predicted), 1)
    return counts


def format_text(counts: np.ndarray) -> str:
    """Per-class accuracy and the confusion matrix as text (rows: true class, columns: predicted)."""
    n = len(counts)
    lines = ["class  accuracy   " + " ".join(f"{j:>4d}" for j in range(n))]
    for i in range(n):
        accuracy = counts[i, i] / max(1, counts[i].sum())
        lines.append(f"{i:>5d}  {accuracy:>8.1%}   " + " ".join(f"{c:>4d}" for c in counts[i]))
    return "\n".join(lines)


def plot(counts: np.ndarray, png: Path, title: str) -> Path | None:
    """The confusion matrix as a small PNG; None when matplotlib is missing."""
    plt = plots.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(4, 3.6))
    ax.imshow(np.log1p(counts), cmap="Blues")
    for (i, j), c in np.ndenumerate(counts):
        if c:
            ax.text(j, i, str(c), ha="center", va="center", fontsize=7, color="white" if i == j else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_xticks(range(len(counts)))
    ax.set_yticks(range(len(counts)))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png
