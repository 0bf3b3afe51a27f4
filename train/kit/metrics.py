"""What a run writes as it goes: metrics.jsonl, one JSON object per line (`MetricsLog`), and the progress bar
on a terminal (`live_bar`)."""

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


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


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"
