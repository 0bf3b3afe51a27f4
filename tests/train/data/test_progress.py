"""train.data.progress: the line says how much is done of what whole, at what rate; in a log (not a terminal)
a line at a time, at most every `every` seconds."""

import io
import re

from train.data.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_line_at_most_every_interval_and_a_last_one():
    log = io.StringIO()
    progress = Progress("encoded", 4_000_000, stream=log, every=0.0)
    for done in (1_000_000, 2_000_000):
        progress.update(done)
    quiet = Progress("encoded", 4_000_000, stream=io.StringIO(), every=3600.0)
    quiet.update(1_000_000)
    assert quiet.stream.getvalue() == ""  # within the interval: nothing
    progress.update(4_000_000)
    progress.finish()
    lines = log.getvalue().splitlines()
    assert re.fullmatch(r"encoded 1\.0 of 4\.0 MB \(25%\), [\d.]+ MB/s, \d+ s left", lines[0])
    assert lines[1].startswith("encoded 2.0 of 4.0 MB (50%)")
    assert re.fullmatch(r"encoded 4\.0 of 4\.0 MB \(100%\), [\d.]+ MB/s, in [\d.]+ s", lines[-1])


def test_on_a_terminal_the_line_is_rewritten_in_place():
    screen = Terminal()
    progress = Progress("encoded", 2_000_000, stream=screen)
    progress.every = 0.0
    progress.update(1_000_000)
    progress.finish()
    shown = screen.getvalue()
    assert shown.startswith("\rencoded 1.0 of 2.0 MB (50%)") and shown.count("\r") == 2 and shown.endswith("\n")
