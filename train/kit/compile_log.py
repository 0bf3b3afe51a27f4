"""Which programs a run compiled: each one's function, its arguments' shapes and its seconds in XLA's compiler,
what `--log_compiles` prints after the compile summary.

    programs = compile_log.ProgramLog()      # before anything compiles
    ...
    for program in programs.stop():          # in the order they compiled
        print(program)     # "train_step  0.71 s  (f32[4,128,128], f32[4,128,384], ... 38 arrays)"

A jitted function compiles once per set of argument shapes and dtypes (and static arguments); code run op by op
outside `jax.jit` compiles a small program per operation and shape, which is how an initialiser run eagerly
costs dozens of programs. The list says which is which: `new_state`, `train_step` and `eval_loss` are the
programs' own functions; names like `multiply` or `broadcast_in_dim` are single operations run op by op.

The names and seconds come from `jax.monitoring`; the shapes from JAX's own compile log (`jax_log_compiles`),
which this switches on while it listens and keeps off the console: the records it reads are taken from the
`jax` logger, and every other record of that logger goes on to the root logger as before.
"""

import dataclasses
import logging
from typing import Any

import jax
from jax import monitoring

from train.kit.compile_cache import BACKEND_COMPILE

# With jax_log_compiles JAX logs these at WARNING around each compilation; the first carries the shapes.
COMPILE_CHATTER = ("Compiling ", "Finished ", "Persistent compilation cache hit", "Writing ", "Not writing ")
SHOWN_SHAPES = 6  # per program; the rest are counted


@dataclasses.dataclass
class Program:
    """One compilation: the jitted function's name, its arguments' shapes (as JAX writes them short,
    `f32[4,128]`) and the seconds XLA's compiler took (for a cache hit, the time to load it)."""

    name: str
    seconds: float
    shapes: tuple[str, ...] = ()
    differs: tuple[str, ...] = ()  # for a function compiled again: the shapes that differ from its first compile

    def __str__(self) -> str:
        shown = ", ".join(self.shapes[:SHOWN_SHAPES])
        if len(self.shapes) > SHOWN_SHAPES:
            shown += f", ... {len(self.shapes)} arrays"
        again = f"; again for {', '.join(self.differs)}" if self.differs else ""
        return f"{self.name:<24} {self.seconds:6.2f} s  ({shown}{again})"


class ProgramLog:
    """Records every compilation from its creation until `stop()`, which returns them as `Program`s and puts
    JAX's logging back as it found it. Process-wide, like JAX's compile cache."""

    def __init__(self):
        self.programs: list[Program] = []
        self._shapes: dict[str, list[tuple[str, ...]]] = {}  # by name, lowered but not yet compiled
        self._logger, self._handler = logging.getLogger("jax"), _Capture(self._lowered)
        self._was = jax.config.jax_log_compiles, self._logger.propagate
        jax.config.update("jax_log_compiles", True)
        self._logger.addHandler(self._handler)
        self._logger.propagate = False  # the handler passes on what is not compile chatter
        monitoring.register_event_duration_secs_listener(self._compiled)

    def _lowered(self, name: str, avals: Any) -> None:
        shapes = tuple(_short(aval) for aval in avals) if isinstance(avals, (tuple, list)) else (str(avals),)
        self._shapes.setdefault(name, []).append(shapes)

    def _compiled(self, event: str, seconds: float, **kwargs: Any) -> None:
        if event != BACKEND_COMPILE:
            return
        name = str(kwargs.get("fun_name", "?"))
        pending = self._shapes.get(name) or [()]
        self.programs.append(Program(_plain(name), seconds, pending.pop(0)))

    def stop(self) -> list[Program]:
        monitoring.unregister_event_duration_listener(self._compiled)
        self._logger.removeHandler(self._handler)
        jax.config.update("jax_log_compiles", self._was[0])
        self._logger.propagate = self._was[1]
        first: dict[str, Program] = {}
        for program in self.programs:
            earlier = first.setdefault(program.name, program)
            if earlier is not program:  # why it compiled again: the arguments whose shape or dtype changed
                changed = [f"arg {i}: {b}" for i, (a, b) in enumerate(zip(earlier.shapes, program.shapes)) if a != b]
                program.differs = tuple(changed) or (f"{len(program.shapes)} arrays",)
        return self.programs


class _Capture(logging.Handler):
    """Reads the shapes from JAX's "Compiling <name> with global shapes and types <avals>" records, drops the
    rest of the compile chatter, and hands any other record to the root logger."""

    def __init__(self, lowered):
        super().__init__(logging.DEBUG)
        self.lowered = lowered

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if not message.startswith(COMPILE_CHATTER):
            logging.getLogger().handle(record)
        elif message.startswith("Compiling ") and isinstance(record.args, tuple) and len(record.args) >= 2:
            self.lowered(str(record.args[0]), record.args[1])


def _short(aval: Any) -> str:
    """`f32[4,128]` for an abstract array (its `str_short`), else its str."""
    try:
        return aval.str_short(short_dtypes=True)
    except (AttributeError, TypeError):
        return str(aval)


def _plain(name: str) -> str:
    """`train_step` for JAX's `jit(train_step)`."""
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
