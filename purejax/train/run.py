"""What every training program needs around its loop: checking the output directory, stopping cleanly on
SIGTERM/SIGINT (preemptible machines), a progress bar, a metrics log, a loss-curve plot, and the machine's
measured matmul rate for MFU. The loop itself is `purejax.train.loop`."""

import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from purejax.train.data.prepare import check_writable

NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib, or purejax[examples])"


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create `out_dir` and prove it is writable now, before anything compiles or trains."""
    try:
        return check_writable(out_dir, what="checkpoints and logs")
    except OSError as e:
        raise SystemExit(f"error: {e}") from None


class StopSignal:
    """SIGTERM and SIGINT over the whole run of a program, from its first line until it returns.

    - Starting up (parsing, preparing data, building the state): nothing has trained yet, so the first signal
      exits at once with a line saying so (status 128 + the signal's number), never a traceback.
    - Training (from `training()`): the first signal is a request, `requested` becomes True, and the loop saves
      a checkpoint after the step in flight and exits with status 0. Python runs a handler between bytecodes,
      so a signal that arrives while XLA compiles is seen when the compilation returns.
    - Finishing (from `finishing()`, after the last checkpoint): the first signal exits at once, status 0.

    A second signal exits at once, without saving. One that comes within `SAME_NOTICE` seconds of the first
    is the same notice delivered twice (Ctrl-C reaches a launcher and its children, and the launcher forwards
    it too) and is ignored. Once a signal has arrived, the handlers stay installed after the `with` block,
    so a late Ctrl-C while the interpreter exits never shows a traceback; otherwise the previous ones return.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SAME_NOTICE = 0.25  # seconds

    def __init__(self):
        self.requested = False
        self.phase = "starting"
        self._received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def training(self) -> None:
        self.phase = "training"

    def finishing(self) -> None:
        self.phase = "finishing"
        if self.requested:  # asked during the last save: it is done, so leave now
            raise SystemExit(0)

    def _handle(self, signum: int, frame: Any) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self._received_at is not None:
            if now - self._received_at < self.SAME_NOTICE:
                return
            _exit_now(signum, frame)
        self._received_at = now
        if self.phase == "training":
            self.requested = True
            _say(f"{name}: saving a checkpoint after this step, then exiting (send again to exit now)")
            return
        _say(f"{name}: {'nothing trained yet' if self.phase == 'starting' else 'everything is saved'}; exiting")
        raise SystemExit(128 + signum if self.phase == "starting" else 0)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, _exit_now if self._received_at is not None else handler)


def _say(line: str) -> None:
    print(f"\n{line}", file=sys.stderr, flush=True)


def _exit_now(signum: int, frame: Any) -> None:
    _say(f"{signal.Signals(signum).name} again: exiting now, without saving")
    sys.stdout.flush()
    os._exit(128 + signum)


class MetricsLog:
    """Appends one JSON object per line to `path` (metrics.jsonl): easy to tail, grep, and load with pandas.

    Strict JSON: a NaN or infinite number (a diverged loss) is written as `null`, which every JSON reader
    accepts; Python's `json` would write a bare `NaN`, which is not JSON and which strict readers reject."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write(self, **row: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _plain(v) for k, v in row.items()}, allow_nan=False) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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


# Dense (no sparsity) bfloat16 peak FLOP/s by `jax.Device.device_kind`, first match wins: the vendors' data
# sheets. NVIDIA lists tensor-core rates "with sparsity", twice the dense ones: H100 SXM 1,979 TFLOPS, H100 PCIe
# 1,513, H100 NVL 1,671 (H100 datasheet); H200 SXM 1,979, H200 NVL 1,671 (H200 datasheet); L4 242 (L4 datasheet).
# A100 312 dense (A100 datasheet). Google Cloud's TPU pages: v4 275, v5e ("TPU v5 lite") 197, v5p ("TPU v5") 459.
PEAK_BF16_FLOPS = (
    (r"H100.*PCIe", 756e12), (r"H[12]00 NVL", 835e12), (r"H100|H200", 989e12), (r"A100", 312e12),
    (r"\bL4\b", 121e12), (r"TPU v4", 275e12), (r"TPU v5 ?(lite|e)", 197e12), (r"TPU v5", 459e12),
)  # fmt: skip


def accelerator_peak_flops(device_kind: str) -> float | None:
    """The dense bfloat16 peak of the accelerator `device_kind` names ("NVIDIA H100 80GB HBM3", "TPU v4"), or
    None for a device the table does not know (and for CPUs)."""
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_kind)), None)


def peak_flops() -> float:
    """What MFU is a fraction of: the accelerator's dense bfloat16 peak (`PEAK_BF16_FLOPS`, nanoGPT's convention
    on a GPU), or on a CPU or an unknown device the float32 matmul rate measured here."""
    import jax

    device = jax.devices()[0]
    return (device.platform != "cpu" and accelerator_peak_flops(device.device_kind)) or measure_matmul_flops()


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"
