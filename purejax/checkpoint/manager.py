"""`CheckpointManager`: a directory of checkpoints, one file per step, with retention and crash recovery.

    manager = CheckpointManager("runs/gpt2", keep_last=3, keep_best=1, metric="val_loss", mode="min")
    restored = manager.restore(like=state)      # the newest checkpoint that verifies, or None in a new run
    ...
    manager.save(step, state, metadata={"val_loss": val_loss})

Files are named `ckpt_00001000.msgpack` (the prefix is configurable), so they sort by step. Old files are
deleted only after the new one is durable (fsynced and renamed), so a crash never leaves fewer good
checkpoints than `keep_last`. A file that fails verification is reported with a warning, skipped, and never
deleted (keep it for inspection; delete it by hand).
"""

import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxtyping import Array

from purejax.checkpoint import format as fmt
from purejax.checkpoint.format import CheckpointError, CheckpointInfo
from purejax.checkpoint.read import Restored, read_metadata, restore
from purejax.checkpoint.write import TEMP_SUFFIX, fsync_dir, save

PyTree = Any


class CheckpointManager:
    """Save by step into `directory`, keep the newest `keep_last` (None: all) and, with `metric`, also the
    best `keep_best` by `metadata[metric]` (`mode` "min" or "max"); restore the newest valid one.

    On construction it creates the directory and removes temporary files left by saves that were killed
    (`.ckpt_*.tmp`); so do not point two running jobs at one directory. In a multi-process run every
    process calls `save` (it is collective) and only process 0 touches the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        keep_best: int = 0,
        metric: str | None = None,
        mode: str = "min",
        prefix: str = "ckpt",
        chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
    ):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}")
        if keep_best < 0 or (keep_best and metric is None):
            raise ValueError(f"keep_best={keep_best} needs a non-negative count and a `metric` to rank by")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' (lower {metric} is better) or 'max', got {mode!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", prefix):
            raise ValueError(f"prefix {prefix!r} must be letters, digits, '_' and '-', not starting with '.'")
        self.directory = Path(directory)
        self.keep_last, self.keep_best, self.metric, self.mode = keep_last, keep_best, metric, mode
        self.prefix, self.chunk_bytes = prefix, chunk_bytes
        self._pattern = re.compile(rf"{re.escape(prefix)}_(\d+)\.msgpack")
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for leftover in self.directory.glob(f".{prefix}_*{TEMP_SUFFIX}"):
                leftover.unlink(missing_ok=True)

    def path(self, step: int) -> Path:
        """The file for `step`, e.g. `directory/ckpt_00001000.msgpack`."""
        return self.directory / f"{self.prefix}_{step:08d}.msgpack"

    def steps(self) -> list[int]:
        """Every step with a checkpoint file in the directory, oldest first (valid or not)."""
        if not self.directory.is_dir():  # other processes may look before process 0 has created it
            return []
        found = (self._pattern.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(
        self,
        step: int | np.integer | Array,
        tree: PyTree,
        *,
        config: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Save `tree` as `step` (see `purejax.checkpoint.save`), then delete what the retention policy drops."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if self.keep_best:
            score = fmt.plain((metadata or {}).get(self.metric), "score")
            if not isinstance(score, (int, float)) or isinstance(score, bool):
                ranks = f"keep_best={self.keep_best} ranks by metadata[{self.metric!r}]"
                raise ValueError(f"{ranks}: pass a number there, got {score!r}")
        path = save(self.path(step), tree, step=step, config=config, metadata=metadata, chunk_bytes=self.chunk_bytes)
        if jax.process_index() == 0:
            self._prune(keep=step)
        return path

    def latest_step(self) -> int | None:
        """The newest step whose file has a valid header and the right length (arrays are verified on restore)."""
        for step in reversed(self.steps()):
            try:
                read_metadata(self.path(step))
                return step
            except CheckpointError as e:
                warnings.warn(f"skipping an unreadable checkpoint: {e}", RuntimeWarning, stacklevel=2)
        return None

    def restore(
        self, like: PyTree = None, *, step: int | None = None, subtree: str | None = None, cast: bool = False
    ) -> Restored | None:
        """Restore `step`, or by default the newest checkpoint that verifies (see `purejax.checkpoint.restore`).

        A corrupt or truncated newer file is reported with a warning and the next older one is tried. Returns
        None when the directory has no checkpoints (a fresh run); raises CheckpointError when it has some but
        none is readable, rather than silently starting over."""
        if step is not None:
            return restore(self.path(step), like, subtree=subtree, cast=cast)
        failures = []
        for candidate in reversed(self.steps()):
            try:
                return restore(self.path(candidate), like, subtree=subtree, cast=cast)
            except CheckpointError as e:
                warnings.warn(f"skipping an unreadable checkpoint: {e}", RuntimeWarning, stacklevel=2)
                failures.append(str(e))
        if failures:
            problem = "no checkpoint in the directory is readable:\n  " + "\n  ".join(failures)
            raise CheckpointError(self.directory, problem)
        return None

    def _prune(self, keep: int) -> None:
        infos: dict[int, CheckpointInfo] = {}
        for step in self.steps():
            try:
                infos[step] = read_metadata(self.path(step))
            except (CheckpointError, FileNotFoundError):
                continue  # unreadable files are never deleted; restore reports and skips them
        kept = {keep, *sorted(infos)[-self.keep_last :]} if self.keep_last else set(infos)
        if self.keep_best:
            scores = {s: info.metadata.get(self.metric) for s, info in infos.items()}
            scored = [(score, s) for s, score in scores.items() if _is_score(score)]
            scored.sort(reverse=self.mode == "max")
            kept |= {s for _, s in scored[: self.keep_best]}
        for step in infos.keys() - kept:
            self.path(step).unlink(missing_ok=True)
        fsync_dir(self.directory)


def _is_score(value: Any) -> bool:
    """A number that can be ranked (NaN never counts as best)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
