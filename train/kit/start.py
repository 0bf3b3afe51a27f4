"""The start of every training run, the lines each program's `main` would otherwise repeat:

    def main(argv=None) -> dict:
        with start.run(FlowSettings, argv, program="train.flow", doc=__doc__, default_preset="flow_digits") as run:
            settings, saved = run.settings, run.saved_config()
            ...                                      # the data, the model, the state: the program's own
            return train(run, settings, model_config, data, StartingPoint(state, resumed, checkpoint_config))

In order, before anything compiles: stop signals are handled (`signals.StopSignal`: a signal while starting
ends the process with one line), the settings are parsed (`--help` prints them and exits), the devices are
started (with `devices=True`: the mesh and the processes of `train.gpt`; else one device), what depends on the
machine is resolved (`TrainSettings.on_this_machine`), out_dir is proven writable, and the compile cache,
profiler and loggers are switched on (`observe.Observer`). `Run.loop` then makes the shared loop with what
every program passes it the same way.
"""

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from purejax import checkpoint, optim
from purejax.parallel import distributed
from train.data.prepare import check_writable
from train.kit import observe, resume, signals
from train.kit import settings as settings_lib
from train.kit.devices import Devices, start_devices
from train.kit.loop import Loop


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create `out_dir` and prove it is writable now, before anything compiles or trains."""
    try:
        return check_writable(out_dir, what="checkpoints and logs")
    except OSError as e:
        raise SystemExit(f"error: {e}") from None


class StartingPoint(NamedTuple):
    """Where a program's `train` starts, as its `main` prepared it: the state, the checkpoint it was restored
    from (None for a new run) and what every checkpoint of the run records (`Run.checkpoint_config`)."""

    state: optim.TrainState
    resumed: checkpoint.CheckpointInfo | None
    checkpoint_config: dict


@dataclasses.dataclass(frozen=True)
class Run:
    """What a program's `main` starts with: the settings as parsed (before a resume merges the checkpoint's),
    the command line, the handlers of stop signals, the observer, the devices, out_dir and its checkpoints."""

    program: str
    settings: Any
    argv: list[str]
    stop: signals.StopSignal
    observer: observe.Observer
    devices: Devices
    out_dir: Path
    manager: checkpoint.CheckpointManager

    @property
    def main(self) -> bool:
        """Whether this is the process that prints and writes files (the only one, in most runs)."""
        return self.devices.num_processes == 1 or distributed.is_main()

    def saved_config(self, parts: Iterable[str] = ("train",)) -> dict | None:
        """With --init_from=resume, the config of out_dir's newest checkpoint (`resume.saved_config`); else None."""
        if self.settings.init_from != "resume":
            return None
        return resume.saved_config(self.manager, self.program, parts)

    def resumed_settings(self, saved: dict, fixed: Iterable[str], given: Iterable[str] = ()) -> Any:
        """The settings of a resumed run: the checkpoint's (`saved`, already merged from its parts), then those
        given on this command line (and `given`), refusing a change to a key of `fixed` (`resume.settings`)."""
        named = {*settings_lib.explicit_keys(self.argv), *given}
        return resume.settings(self.settings, named, saved, fixed)

    def checkpoint_config(self, settings: Any, model_config: Any, fingerprint: dict, **parts: Any) -> dict:
        """What every checkpoint of the run records beside the state (`resume.saved_config` reads it back): the
        program, its settings, the model's config, any `parts` of the program's own, and the data's fingerprint."""
        train = {
            "program": self.program,
            "train": dataclasses.asdict(settings),
            "model": dataclasses.asdict(model_config),
        }
        return {**train, **parts, "data": fingerprint}

    def loop(
        self,
        settings: Any,
        save: Callable[..., Path],
        *,
        start: int,
        total: int,
        log_interval: int,
        resumed: bool,
        rates: Callable[[float], dict[str, float]] = lambda seconds_per_step: {},
    ) -> Loop:
        """The shared loop over out_dir, with this run's stop signals, observer and devices."""
        return Loop(
            self.out_dir,
            self.stop,
            save,
            start=start,
            total=total,
            log_interval=log_interval,
            progress=settings.progress,
            max_bad_steps=settings.max_bad_steps,
            resumed=resumed,
            main=self.main,
            rates=rates,
            agree=self.devices.stop_agreement(),
            observer=self.observer,
        )


@contextlib.contextmanager
def run(
    settings_class: type,
    argv: list[str] | None,
    *,
    program: str,
    doc: str,
    default_preset: str | None = None,
    devices: bool = False,
) -> Iterator[Run]:
    """The run of `program` (e.g. "train.flow") with `settings_class` parsed from `argv` (default: the command
    line), started as the module docstring says; signals stay handled and the observer on until the block ends."""
    argv = sys.argv[1:] if argv is None else argv
    with signals.StopSignal() as stop, observe.Observer() as observer:  # a signal while starting up: no traceback
        settings = settings_lib.command_line(settings_class, argv, prog=program, doc=doc, default_preset=default_preset)
        machine = start_devices(settings) if devices else Devices()
        settings = settings.on_this_machine()
        out_dir = prepare_out_dir(settings.out_dir)
        manager = checkpoint.CheckpointManager(out_dir, keep_last=settings.keep_checkpoints)
        started = Run(program, settings, argv, stop, observer, machine, out_dir, manager)
        observer.start(settings, out_dir, config=dataclasses.asdict(settings), main=started.main)  # before compiling
        yield started
