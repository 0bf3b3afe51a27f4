"""`CheckpointManager`: a directory of checkpoints, one file per step, with retention and crash recovery.

    manager = CheckpointManager("runs/gpt2", keep_last=3, keep_best=1, metric="val_loss", mode="min")
    restored = manager.restore(like=state)      # the newest checkpoint that verifies, or None in a new run
    ...
    manager.save(step, state, metadata={"val_loss": val_loss})

Files are named `ckpt_00001000.msgpack` (the prefix is configurable), so they sort by step. Old files are
deleted only after the new one is durable (fsynced and renamed), so a crash never leaves fewer good
checkpoints than `keep_last`. A file that fails verification is reported with a warning, skipped, and never
deleted (keep it for inspection; delete it by hand).

One writer, any number of readers. Only `save` changes the directory: it writes, prunes, and removes the
temporary files of saves that were killed. Constructing a manager and reading (`steps`, `latest_step`,
`restore`) change nothing, so a sampler or an evaluation job may read while a training run writes: it sees
only complete checkpoints (each appears by an atomic rename) and passes over one the writer deletes
meanwhile. Two runs *saving* into one directory are not supported: each would prune the other's files.
"""

import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxtyping import Array

from purejax.checkpoint import format as fmt
from purejax.checkpoint.format import CheckpointError, CheckpointWriteError
from purejax.checkpoint.header import plain
from purejax.checkpoint.read import Restored, read_metadata, restore
from purejax.checkpoint.write import fsync_dir, save, temp_owner

PyTree = Any
STALE_TEMP_SECONDS = 3600  # a temporary file nobody has written to for this long is a killed save's


class CheckpointManager:
    """Save by step into `directory`, keep the newest `keep_last` (None: all) and, with `metric`, also the
    best `keep_best` by `metadata[metric]` (`mode` "min" or "max"); restore the newest valid one.

    Reading never changes the directory; `save` is its only writer (see the module's docstring). In a
    multi-process run every process calls `save` (it is collective) and only process 0 touches the directory.
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
        self._pattern = re.compile(rf"{re.escape(prefix)}_(\d{{1,19}})\.msgpack")
        self._checked: dict[int, tuple[tuple, Any]] = {}  # step -> (the file's identity, metadata or error)

    def path(self, step: int) -> Path:
        """The file for `step`, e.g. `directory/ckpt_00001000.msgpack`."""
        return self.directory / f"{self.prefix}_{step:08d}.msgpack"

    def steps(self) -> list[int]:
        """Every step with a checkpoint file in the directory, oldest first (valid or not; regular files only:
        a directory or FIFO with a checkpoint's name is passed over)."""
        if not self.directory.is_dir():  # a new run's, or other processes looking before process 0 made it
            return []
        with os.scandir(self.directory) as entries:
            found = [(self._pattern.fullmatch(e.name), e) for e in entries]
            return sorted(int(m.group(1)) for m, e in found if m and e.is_file())

    def save(
        self,
        step: int | np.integer | Array,
        tree: PyTree,
        *,
        config: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Save `tree` as `step` (see `purejax.checkpoint.save`), then delete what the retention policy drops.
        Before writing, it removes the temporary files of killed saves (`.ckpt_*.tmp`) whose process is gone.

        When the disk is full, raises CheckpointWriteError naming, besides the file and the space it needs and
        the space left, the last good checkpoint (`last_good`), the one a rerun would resume from."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if self.keep_best:
            score = plain((metadata or {}).get(self.metric), "score")
            if not isinstance(score, (int, float)) or isinstance(score, bool):
                ranks = f"keep_best={self.keep_best} ranks by metadata[{self.metric!r}]"
                raise ValueError(f"{ranks}: pass a number there, got {score!r}")
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
        path = self.path(step)
        try:
            save(path, tree, step=step, config=config, metadata=metadata, chunk_bytes=self.chunk_bytes)
        except CheckpointWriteError as e:
            raise self._with_last_good(e) from None
        if jax.process_index() == 0:
            self._prune(keep=step)
        return path

    def _with_last_good(self, error: CheckpointWriteError) -> CheckpointWriteError:
        """`error`, saying which checkpoint is now the newest good one: the one a rerun resumes from."""
        last = self.latest_step()
        last_good = None if last is None else self.path(last)
        kept = f"the last good checkpoint is {last_good}" if last_good else f"{self.directory} has no checkpoint yet"
        needed, free = error.needed, error.free
        return CheckpointWriteError(error.path, error.errno, needed=needed, free=free, kept=kept, last_good=last_good)

    def latest_step(self) -> int | None:
        """The newest step whose file has a valid header and the right length (arrays are verified on restore);
        an unreadable newer file is reported with a warning and skipped."""
        for step in self._newest_first():
            try:
                self._metadata(step)
                return step
            except FileNotFoundError:
                continue  # deleted since the listing: pruned by the run writing here
            except CheckpointError as e:
                warnings.warn(f"skipping an unreadable checkpoint: {e}", RuntimeWarning, stacklevel=2)
        return None

    def restore(
        self, like: PyTree = None, *, step: int | None = None, subtree: str | None = None, cast: bool = False
    ) -> Restored | None:
        """Restore `step`, or by default the newest checkpoint that verifies (see `purejax.checkpoint.restore`).

        Without `step`, an unreadable, corrupt or truncated newer file is reported with a warning and the next
        older one is tried. Returns None when the directory has no checkpoints (a fresh run); raises
        CheckpointError when it has some but none is readable, rather than silently starting over. With
        `step`, raises CheckpointError (naming the steps there are) if there is no checkpoint for it."""
        if step is not None:
            try:
                return restore(self.path(step), like, subtree=subtree, cast=cast)
            except FileNotFoundError:
                there = _describe_steps(self.steps())
                raise CheckpointError(self.path(step), f"no checkpoint for step {step}; {there}") from None
        failures = []
        for candidate in self._newest_first():
            try:
                return restore(self.path(candidate), like, subtree=subtree, cast=cast)
            except FileNotFoundError:
                continue  # deleted since the listing: pruned by the run writing here, which saved a newer one
            except CheckpointError as e:
                warnings.warn(f"skipping an unreadable checkpoint: {e}", RuntimeWarning, stacklevel=2)
                failures.append(str(e))
        if failures:
            problem = "no checkpoint in the directory is readable:\n  " + "\n  ".join(failures)
            raise CheckpointError(self.directory, problem)
        return None

    def _newest_first(self) -> Iterator[int]:
        """Steps from the newest down, listing the directory again before each, so that a checkpoint the
        writer saves meanwhile is found too."""
        tried: set[int] = set()
        while untried := [s for s in self.steps() if s not in tried]:
            tried.add(untried[-1])
            yield untried[-1]

    def _metadata(self, step: int) -> dict[str, Any]:
        """The metadata of `step`'s file, or CheckpointError if it cannot be read. A file is read again only
        when it has changed (inode, size, modification or status change), so a damaged one is not parsed on
        every save."""
        path = self.path(step)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CheckpointError(path, f"cannot be examined: {e.strerror or e}") from None
        identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        if self._checked.get(step, (None,))[0] != identity:
            try:
                self._checked[step] = identity, read_metadata(path).metadata
            except CheckpointError as e:
                self._checked[step] = identity, e
        found = self._checked[step][1]
        if isinstance(found, CheckpointError):
            raise CheckpointError(found.path, found.problem, leaf=found.leaf)
        return found

    def _prune(self, keep: int) -> None:
        steps = self.steps()
        self._checked = {s: checked for s, checked in self._checked.items() if s in steps}
        readable: dict[int, dict[str, Any]] = {}
        for step in steps:
            try:
                readable[step] = self._metadata(step)
            except (CheckpointError, FileNotFoundError):
                continue  # unreadable files are never deleted; restore reports and skips them
        kept = {keep, *sorted(readable)[-self.keep_last :]} if self.keep_last else set(readable)
        if self.keep_best:
            scored = [(metadata.get(self.metric), s) for s, metadata in readable.items()]
            scored = sorted(((v, s) for v, s in scored if _is_score(v)), reverse=self.mode == "max")
            kept |= {s for _, s in scored[: self.keep_best]}
        for step in readable.keys() - kept:
            try:
                self.path(step).unlink(missing_ok=True)
            except OSError as e:  # e.g. on Windows, while a reader has it open: the next save tries again
                problem = f"could not delete the old checkpoint {self.path(step)}: {e}"
                warnings.warn(problem, RuntimeWarning, stacklevel=3)
        fsync_dir(self.directory)

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporary files (`write.temp_path`) of this directory's checkpoints whose writing process
        is no longer running on this machine, or which nobody has written to for `STALE_TEMP_SECONDS` (a pid
        reused since, or a run on another machine that died). This process's own are never touched: they
        may be a save in progress on another thread (a failed save removes its own)."""
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                owner = temp_owner(entry.name)
                if owner is None or not self._pattern.fullmatch(owner[0]) or owner[1] == os.getpid():
                    continue
                try:
                    if not _running(owner[1]) or now - entry.stat().st_mtime > STALE_TEMP_SECONDS:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue  # renamed into place or removed by its writer meanwhile


def _running(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (where that cannot be asked, on Windows: assume so)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _describe_steps(steps: list[int]) -> str:
    if not steps:
        return "the directory has none"
    if len(steps) <= 10:
        return f"the directory has steps {', '.join(map(str, steps))}"
    shown = ", ".join(map(str, steps[:3])) + ", ..., " + ", ".join(map(str, steps[-5:]))
    return f"the directory has steps {shown} ({len(steps)} in all)"


def _is_score(value: Any) -> bool:
    """A number that can be ranked (NaN never counts as best)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
