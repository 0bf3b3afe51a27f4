"""What every training program needs around its loop: checking the output directory, stopping cleanly on
SIGTERM/SIGINT (preemptible machines), a progress bar, a metrics log, a loss-curve plot, and the machine's
measured matmul rate for MFU."""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from purejax.train.data.prepare import check_writable


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create `out_dir` and prove it is writable now, before anything compiles or trains."""
    try:
        return check_writable(out_dir, what="checkpoints and logs")
    except OSError as e:
        raise SystemExit(f"error: {e}") from None


class StopSignal:
    """Turns the first SIGTERM or SIGINT into a request to stop (`requested` becomes True, the program saves
    a checkpoint and exits); a second one exits at once. Use as a context manager around the loop; the
    previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.requested:
            print(f"\nsecond {signal.Signals(signum).name}: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint, then exiting (send again to exit now)",
              file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignal":
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class MetricsLog:
    """Appends one JSON object per line to `path` (metrics.jsonl): easy to tail, grep, and load with pandas."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write(self, **row: Any) -> None:
        clean = {k: (float(v) if hasattr(v, "dtype") or isinstance(v, float) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def progress(total: int, initial: int = 0, enabled: bool = True, desc: str = "train", quiet: bool = False):
    """A tqdm bar when tqdm is installed (the examples extra) and `enabled`, else a stand-in that prints
    nothing but the lines given to `.write` (nothing at all when `quiet`: the processes of a multi-process
    run other than the main one); both take `.update(n)`, `.set_postfix_str(s)`, `.write(s)` and `.close()`."""
    if enabled and not quiet:
        try:
            from tqdm import tqdm

            return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            pass
    return _NoBar(quiet)


class _NoBar:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str) -> None:
        if not self.quiet:
            print(s, flush=True)

    def close(self) -> None:
        pass


def plot_losses(log: MetricsLog, png: str | os.PathLike, title: str = "loss") -> Path | None:
    """Train and val loss against step from the metrics log, as a PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = log.read()
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [r["iter"] for r in rows if "loss" in r]
    ax.plot(steps, [r["loss"] for r in rows if "loss" in r], label="train (batch)", alpha=0.5)
    for name in ("train_loss", "val_loss"):
        points = [(r["iter"], r[name]) for r in rows if name in r]
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


def measure_matmul_flops(n: int = 1024, seconds: float = 0.5) -> float:
    """The machine's float32 matmul rate (FLOP/s) for an n x n matmul under jit: the peak MFU is against."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a).block_until_ready()
        calls += 1
    return 2 * n**3 * calls / (time.perf_counter() - start)


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"
