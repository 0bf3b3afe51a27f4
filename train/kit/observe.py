"""Looking inside a run: the settings every training program shares for it, and the `Observer` that carries
them out around the shared loop (`train.kit.loop`).

    @dataclass(frozen=True)
    class TrainSettings(observe.RunSettings):     # --compile_cache, --profile, --tensorboard, --wandb_log ...
        ...

    with signals.StopSignal() as stop, observe.Observer() as observer:     # as `start.run` does
        settings = settings_lib.command_line(...)
        observer.start(settings, out_dir, config=dataclasses.asdict(settings))   # before anything compiles
        Loop(..., observer=observer).run(...)     # the profiler around its steps, its rows to the loggers

- the compilation cache (`compile_cache`): on from `start`; when the program ends, a line and a last row of
  metrics.jsonl (at its last iteration) say how many programs it compiled, in how many seconds, and how many
  came from the cache; with `--log_compiles`, a line per program follows (`compile_log`: its function, its
  arguments' shapes, its seconds);
- `--profile=START:STOP`: a `jax.profiler` trace of iterations START to STOP (the steps that take the state
  from iteration START to STOP) in out_dir/profile, as XProf's `.xplane.pb` and Perfetto's
  `perfetto_trace.json.gz` (docs/train-gpt.md says how to open them). The loop waits for the device before
  the first traced step and after the last, so the trace holds those steps and only them;
- `--tensorboard`, `--wandb_log`: every row of metrics.jsonl (training and evaluation) also goes to TensorBoard
  event files in out_dir/tensorboard or to a W&B run (`loggers`); a missing package is an error at `start`.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from train.kit import compile_cache, compile_log, loggers
from train.kit.metrics import MetricsLog
from train.kit.settings import setting

PyTree = Any


def profile_window(spec: str) -> tuple[int, int] | None:
    """`--profile=START:STOP` as (start, stop) with 0 <= start < stop; "" is None (no trace)."""
    if not spec:
        return None
    start, colon, stop = spec.partition(":")
    try:
        window = int(start), int(stop)
    except ValueError:
        window = None
    if not colon or window is None or not 0 <= window[0] < window[1]:
        raise ValueError("expected START:STOP, two iterations with 0 <= START < STOP (e.g. --profile=100:110)")
    return window


def traced_in_the_run(settings: Any) -> None:
    """`--profile=START:STOP` within a run of `max_iters` steps (a program that has one): iterations past the
    last are never reached, so such a window would trace part of what was asked for, or nothing."""
    window, last = profile_window(settings.profile), getattr(settings, "max_iters", None)
    if window and last is not None and window[1] > last:
        raise ValueError(
            f"the run ends at max_iters={last}, before iteration STOP={window[1]}; give a window within 0:{last}"
        )


@dataclass(frozen=True)
class RunSettings:
    """The settings of every program that runs the shared loop (its config inherits them); `--help` lists them
    after the program's own."""

    compile_cache: str = setting(
        "auto",
        "the persistent compilation cache's directory; 'auto': $JAX_COMPILATION_CACHE_DIR, else "
        "~/.cache/purejax/jax (off, with a warning, if it cannot be written); 'off': none",
        check=compile_cache.resolve,
    )
    log_compiles: bool = setting(
        False, "after the compile summary, list every program compiled: its function, argument shapes and seconds"
    )
    profile: str = setting(
        "",
        "START:STOP: a jax.profiler trace of those iterations (within the run) in out_dir/profile ('': none)",
        check=profile_window,
        agrees=traced_in_the_run,
    )
    tensorboard: bool = setting(False, "also write the metrics as TensorBoard scalars to out_dir/tensorboard")
    wandb_log: bool = setting(False, "also log the metrics to Weights & Biases (nanoGPT's name)")
    wandb_project: str = setting("purejax", "the W&B project of the run")
    wandb_run_name: str = setting("", "the W&B run's name ('': W&B picks one)")


class Observer:
    """What a run's `RunSettings` ask for, kept from `start` to the end of the `with` block (see the module
    docstring). Only the main process (`main=True`) prints, writes rows and logs; every process compiles
    with the cache and, with `--profile`, writes its own trace."""

    def __init__(self):
        self.out_dir: Path | None = None
        self.main, self.window, self.cache, self.loggers = True, None, None, []
        self._counter: compile_cache.Counter | None = None
        self._programs: compile_log.ProgramLog | None = None
        self._tracing = self._traced = False
        self.last_iter = 0  # the row of compile counts goes at the run's last iteration

    def start(self, settings: RunSettings, out_dir: str | Path, *, config: dict, main: bool = True) -> "Observer":
        """Switch on what `settings` ask for, before anything compiles: the cache, the compile count, the
        loggers (each package imported now, so a missing one fails before any work is done)."""
        self.out_dir, self.main, self.window = Path(out_dir), main, profile_window(settings.profile)
        if main and settings.tensorboard:
            self.loggers.append(loggers.TensorBoard(self.out_dir / "tensorboard"))
        if main and settings.wandb_log:
            self.loggers.append(
                loggers.WandB(
                    project=settings.wandb_project, name=settings.wandb_run_name, config=config, directory=self.out_dir
                )
            )
        self.cache = compile_cache.enable(settings.compile_cache)
        self._counter = compile_cache.Counter()
        self._programs = compile_log.ProgramLog() if settings.log_compiles else None
        return self

    def log(self, row: dict[str, Any]) -> None:
        """A row of metrics.jsonl, to every logger (a row without an iteration has no step to go at)."""
        if "iter" in row:
            self.last_iter = max(self.last_iter, row["iter"])
            for logger in self.loggers:
                logger.write(row)

    def before_step(self, it: int, state: PyTree) -> None:
        """Start the trace before the first step of the window that this run reaches (a resumed run may start
        inside it), once the device has finished what came before."""
        if self.window and not self._traced and self.window[0] <= it < self.window[1]:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.trace_dir), create_perfetto_trace=True)
            self._tracing = self._traced = True

    def after_step(self, it: int, state: PyTree) -> None:
        """Stop the trace once the step that reaches iteration STOP has run on the device."""
        self.last_iter = max(self.last_iter, it)
        if self._tracing and it >= self.window[1]:
            self._stop_trace(state)

    @property
    def trace_dir(self) -> Path:
        name = "profile" if jax.process_count() == 1 else f"profile/process_{jax.process_index()}"
        return self.out_dir / name

    def _stop_trace(self, state: PyTree) -> None:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self._tracing = False
        self.say(f"profile of iterations {self.window[0]}:{self.window[1]}: {self.trace_dir} (docs/train-gpt.md)")

    def say(self, line: str) -> None:
        if self.main:
            print(line, flush=True)

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        """Stop a trace still running (the run ended inside the window), report the compilations and write
        them to metrics.jsonl (unless the run failed: then its error is the last word), close the loggers."""
        if self._tracing:
            self._stop_trace(None)
        programs = self._programs.stop() if self._programs is not None else None
        self._programs = None
        if self._counter is not None:
            counts, self._counter = self._counter.stop(), None
            failed = kind is not None and not (kind is SystemExit and error.code in (0, None))
            if self.main and not failed:
                print(counts.summary(self.cache), flush=True)
                if programs is not None:
                    print("\n".join(f"  {program}" for program in programs), flush=True)
                row = {"iter": self.last_iter, **dataclasses.asdict(counts), "compile_cache": str(self.cache or "off")}
                MetricsLog(self.out_dir / "metrics.jsonl").write(**row)
                self.log(row)
        for logger in self.loggers:
            logger.close()
        self.loggers = []
