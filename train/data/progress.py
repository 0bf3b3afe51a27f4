"""A progress line for work over a corpus: how much is done, how fast, how long is left.

    progress = Progress("encoded", total_bytes)
    progress.update(done_bytes)   # as often as you like: it prints at most every `every` seconds
    progress.finish()             # the last line, with the total time

On a terminal the line is rewritten in place; written to a file or a pipe (a log, CI), a new line at most every
`every` seconds, so a long preparation shows its progress without flooding the log.
"""

import io
import sys
import time

MB = 1e6


class Progress:
    """A progress line about `total` bytes of work called `what` ("encoded"), written to `stream` (stderr)."""

    def __init__(self, what: str, total: int, *, stream: io.TextIOBase | None = None, every: float | None = None):
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.on_terminal = self.stream.isatty()
        self.every = every if every is not None else (0.2 if self.on_terminal else 10.0)
        self.start = self.shown = time.perf_counter()
        self.done = 0

    def line(self) -> str:
        """E.g. "encoded 312.4 of 1,024.0 MB (30%), 41.2 MB/s, 17 s left"."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.done / elapsed
        left = f", {(self.total - self.done) / rate:.0f} s left" if 0 < self.done < self.total else ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.what} {self.done / MB:,.1f} of {self.total / MB:,.1f} MB{share}, {rate / MB:.1f} MB/s{left}"

    def update(self, done: int) -> None:
        """Record `done` bytes of the total as done; print the line when `every` seconds have passed."""
        self.done = done
        now = time.perf_counter()
        if now - self.shown >= self.every:
            self.shown = now
            self._write(self.line())

    def finish(self) -> None:
        """The last line: the whole and the time it took."""
        elapsed = time.perf_counter() - self.start
        self._write(f"{self.line()}, in {elapsed:.1f} s")
        if self.on_terminal:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str) -> None:
        self.stream.write(f"\r{line}\033[K" if self.on_terminal else f"{line}\n")
        self.stream.flush()
