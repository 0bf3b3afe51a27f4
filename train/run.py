"""What every training program needs around its loop: checking the output directory, a progress bar, a
metrics log, a loss-curve plot, a grid of sample images, and the accelerator's peak for MFU. The loop itself
is `train.loop`; stopping on SIGTERM/SIGINT is `train.signals`."""

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from train.data.prepare import check_writable

NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib, or purejax[examples])"


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create `out_dir` and prove it is writable now, before anything compiles or trains."""
    try:
        return check_writable(out_dir, what="checkpoints and logs")
    except OSError as e:
        raise SystemExit(f"error: {e}") from None


class MetricsLog:
    """Appends one JSON object per line to `path` (metrics.jsonl): easy to tail, grep, and load with pandas.

    Strict JSON: a NaN or infinite number (a diverged loss) is written as `null`, which every JSON reader
    accepts; Python's `json` would write a bare `NaN`, which is not JSON and which strict readers reject."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write(self, **row: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _plain(v) for k, v in row.items()}, allow_nan=False) + "\n")

    def drop_after(self, it: int) -> None:
        """Keep only the rows up to iteration `it` (a resumed run's checkpoint): the rows an interrupted run
        logged after it are logged again by the run that resumes. Rewritten whole, then renamed into place."""
        if not self.path.exists():
            return
        every = self.read()
        rows = [row for row in every if row.get("iter", it) <= it]
        if len(rows) == len(every) and self.path.read_bytes().endswith(b"\n"):  # nothing to drop, no torn line
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))
        os.replace(tmp, self.path)

    def read(self) -> list[dict[str, Any]]:
        """Every row; a last line cut short (the process was killed while appending it) is left out."""
        if not self.path.exists():
            return []
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines[:-1]]
        try:
            return rows + [json.loads(line) for line in lines[-1:]]
        except json.JSONDecodeError:
            return rows


def _plain(value: Any) -> Any:
    """A JSON value: array scalars as Python numbers or bools, non-finite floats as None."""
    if hasattr(value, "dtype"):
        value = np.asarray(value).item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def live_bar(total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
    """A tqdm progress bar when `enabled`, tqdm is installed (the examples extra) and stdout is a terminal;
    else None, and the loop prints a plain line every log interval instead (a log file then gets lines, not
    a bar's carriage-return updates)."""
    if not (enabled and sys.stdout.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stdout)


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


# Dense (no sparsity) bfloat16 peak FLOP/s by `jax.Device.device_kind`, first match wins: the vendors' data
# sheets. NVIDIA lists tensor-core rates "with sparsity", twice the dense ones: H100 SXM 1,979 TFLOPS, H100 PCIe
# 1,513, H100 NVL 1,671 (H100 datasheet); H200 SXM 1,979, H200 NVL 1,671 (H200 datasheet); L4 242 (L4 datasheet).
# A100 312 dense (A100 datasheet). Google Cloud's TPU pages: v4 275, v5e ("TPU v5 lite") 197, v5p ("TPU v5") 459.
PEAK_BF16_FLOPS = (
    (r"H100.*PCIe", 756e12),
    (r"H[12]00 NVL", 835e12),
    (r"H100|H200", 989e12),
    (r"A100", 312e12),
    (r"\bL4\b", 121e12),
    (r"TPU v4", 275e12),
    (r"TPU v5 ?(lite|e)", 197e12),
    (r"TPU v5", 459e12),
)


def accelerator_peak_flops(device_kind: str) -> float | None:
    """The dense bfloat16 peak of the accelerator `device_kind` names ("NVIDIA H100 80GB HBM3", "TPU v4"), or
    None for a device the table does not know (and for CPUs)."""
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_kind)), None)


def peak_flops(given: float = 0.0) -> tuple[float | None, str]:
    """What MFU is a fraction of, and where that figure comes from: `given` (`--peak_flops`) when positive,
    else the accelerator's dense bfloat16 peak from its data sheet (`PEAK_BF16_FLOPS`, nanoGPT's convention),
    else None: a CPU, or an accelerator the table does not know, has no stable published peak to divide by.

    A rate measured at start-up is not used: on a shared machine it moved from 14 to 86 GFLOP/s between runs,
    so the same step read as 1% or 124% MFU. A figure a user cannot trust is worse than none."""
    if given > 0:
        return given, f"MFU against {given / 1e12:g} TFLOP/s (--peak_flops)"
    import jax

    device = jax.devices()[0]
    table = accelerator_peak_flops(device.device_kind) if device.platform != "cpu" else None
    if table is None:
        return None, f"no MFU: {device.device_kind!r} has no known peak (--peak_flops=FLOP/s sets one)"
    return table, f"MFU against {table / 1e12:g} TFLOP/s ({device.device_kind}, dense bfloat16, data sheet)"


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"
