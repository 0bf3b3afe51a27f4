"""JAX's persistent compilation cache for the training programs, and a count of what compiling cost a run.

XLA compiles every jitted function once per shape, and a program compiles its step, its evaluation, its
sampler: seconds on a CPU, minutes for a large model. With the cache on, JAX writes each compiled executable
to a directory, keyed by the program, the JAX and XLA versions, the devices and the compile options; a
second run of the same program and config loads them instead of compiling
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html).

    directory = compile_cache.enable("auto")     # before anything compiles; None when off
    counter = compile_cache.Counter()            # counts from here: compiles, seconds, cache hits
    ...
    print(counter.stop().summary(directory))     # "compiled 9 programs in 2.1 s (cache ...: 9 hits, 0 misses)"

`--compile_cache` chooses the directory: "auto" is the one JAX was given already (`JAX_COMPILATION_CACHE_DIR`),
else `$XDG_CACHE_HOME/purejax/jax` (`~/.cache/purejax/jax`); "off" or "" turns the cache off. The directory is
checked before anything compiles: a `~user` that names no user is an error when the settings are read; one that
cannot be created or written is an error when named, and when "auto" chose it a one-line warning that the cache
is off (JAX would otherwise warn at every compilation that it cannot write the entry). JAX only caches
programs that took `jax_persistent_cache_min_compile_time_secs` (default 1 s) to compile, which leaves out
every program of a small CPU run; so the programs set that threshold (and the minimum entry size) to 0, unless
the environment sets them (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, ...). Entries are never evicted:
delete the directory to reclaim the space. A process opens its cache once, at its first compilation with a
directory set; a later run in the same process with another directory keeps writing to the first.
"""

import dataclasses
import os
import sys
from pathlib import Path

import jax
from jax import monitoring

from train.data.prepare import check_writable

OFF = ("", "off")
THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": 0}
# jax's monitoring events (the same names in jax 0.10 and 0.12): a lookup in the cache, a hit, and the time in
# XLA's compiler (for a hit: the time to load the executable from the cache).
REQUEST, HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def default_directory() -> Path:
    """The per-user directory "auto" means when JAX was given none: `$XDG_CACHE_HOME/purejax/jax`."""
    return _expand(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "purejax" / "jax"


def _expand(path: str) -> Path:
    """`path` with a leading `~` or `~user` expanded; a ValueError naming it when there is no such home."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        home = path.split("/")[0]
        raise ValueError(f"{home!r} names no home directory (no such user, or no $HOME); give a full path") from None


def resolve(setting: str) -> Path | None:
    """The directory that `--compile_cache=<setting>` names, None when it turns the cache off; a ValueError
    when a `~user` in it cannot be expanded (the setting's `check`, so it fails when the settings are read)."""
    if setting.strip().lower() in OFF:
        return None
    if setting == "auto":
        given = jax.config.jax_compilation_cache_dir
        return Path(given) if given else default_directory()
    return _expand(setting)


def unwritable(directory: Path) -> str | None:
    """Why files cannot be written in `directory` (created if needed), or None when they can."""
    try:
        check_writable(directory, what="the compilation cache")
    except OSError as e:  # check_writable words its message for --out_dir; the cause is the OSError it caught
        return getattr(e.__context__, "strerror", None) or str(e)
    return None


def enable(setting: str) -> Path | None:
    """Point JAX's persistent cache at `resolve(setting)` (or turn it off) with thresholds low enough that a
    small CPU program is cached too; returns the directory, None when off. Call it before anything compiles.
    A directory that cannot be written is an error when named, and turns the cache off (one warning) when
    "auto" chose it: a run should not fail over a cache nobody asked for."""
    try:
        directory = resolve(setting)
    except ValueError as e:
        raise SystemExit(f"error: --compile_cache={setting}: {e}") from None
    if directory is not None and (reason := unwritable(directory)):
        if setting != "auto":
            raise SystemExit(
                f"error: --compile_cache={setting}: cannot write in {directory} ({reason}); give "
                "another directory, or --compile_cache=off"
            )
        print(
            f"warning: the compile cache is off: {directory} cannot be written ({reason}); give "
            "--compile_cache=<a writable directory>, or --compile_cache=off",
            file=sys.stderr,
            flush=True,
        )
        directory = None
    if directory is not None:
        for name, value in THRESHOLDS.items():
            if name.upper() not in os.environ:
                jax.config.update(name, value)
    jax.config.update("jax_compilation_cache_dir", None if directory is None else str(directory))
    return directory


@dataclasses.dataclass
class Counts:
    """What compiling cost: XLA compilations (cache hits included), their seconds, and the cache's answers (a
    miss is a lookup that found nothing: the program was compiled, and written to the cache)."""

    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0

    def summary(self, directory: Path | None) -> str:
        cache = f"cache {directory}: {self.cache_hits} hits, {self.cache_misses} misses" if directory else "cache off"
        return f"compiled {self.compiles} programs in {self.compile_s:.1f} s ({cache})"


class Counter:
    """Counts compilations through `jax.monitoring` from its creation until `stop()`, which returns the
    `Counts`. The listeners are process-wide; `stop` removes them."""

    def __init__(self):
        self.counts, self._requests = Counts(), 0
        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **kwargs) -> None:
        self._requests += event == REQUEST
        self.counts.cache_hits += event == HIT
        self.counts.cache_misses = self._requests - self.counts.cache_hits

    def _duration(self, event: str, seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            self.counts.compiles += 1
            self.counts.compile_s += seconds

    def stop(self) -> Counts:
        monitoring.unregister_event_listener(self._event)
        monitoring.unregister_event_duration_listener(self._duration)
        return self.counts
