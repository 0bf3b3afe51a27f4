"""Experiment logs beside metrics.jsonl: the same rows as TensorBoard scalars, or as a Weights & Biases run.

    log = loggers.TensorBoard(out_dir / "tensorboard")          # pip install tensorboard
    log = loggers.WandB(project="purejax", name="", config={...}, directory=out_dir)   # pip install wandb
    log.write({"iter": 100, "loss": 2.31, "lr": 1e-3})          # every number of the row, at step `iter`
    log.close()

Neither package is a dependency of purejax: each is imported only when a run asks for it (`--tensorboard`,
`--wandb_log`, nanoGPT's names), and `require` turns a missing one into a one-line error with the command that
installs it, before anything compiles. TensorBoard's own package writes the event files (no TensorFlow needed);
`tensorboard --logdir out_dir/tensorboard` shows them. W&B honours its environment (`WANDB_MODE=offline`
keeps the run on disk, `wandb sync` uploads it later; `WANDB_DIR`, `WANDB_API_KEY`).
"""

import importlib
import math
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def require(module: str, setting: str, package: str) -> ModuleType:
    """`import module`, or SystemExit naming the setting that asked for it and the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(
            f"error: --{setting}=true needs the {package} package, which is not installed: "
            f"pip install {package} (or leave --{setting} off)"
        ) from None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row, without its step (`iter`): what a logger plots."""
    numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "iter"}
    return {k: v for k, v in numbers.items() if math.isfinite(v)}


class TensorBoard:
    """Rows as TensorBoard scalars, one tag per key of the row (`loss`, `val_loss`, `lr`, ...), written by
    tensorboard's `EventFileWriter` into `directory` and flushed with every row."""

    def __init__(self, directory: str | Path):
        require("tensorboard", "tensorboard", "tensorboard")
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(directory))

    def write(self, row: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars(row).items()]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=int(row["iter"]), summary=self._summary(value=values))
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """Rows as the history of a Weights & Biases run (`wandb.init(project, name, config)`, then `log(row,
    step=iter)`), the run's files under `directory`/wandb."""

    def __init__(self, *, project: str, name: str, config: dict[str, Any], directory: str | Path):
        wandb = require("wandb", "wandb_log", "wandb")
        self._run = wandb.init(project=project, name=name or None, config=config, dir=str(directory))

    def write(self, row: dict[str, Any]) -> None:
        self._run.log(scalars(row), step=int(row["iter"]))

    def close(self) -> None:
        self._run.finish()
