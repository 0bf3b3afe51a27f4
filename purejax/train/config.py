"""The settings of a training program: a frozen dataclass whose fields say their default, range and meaning;
presets as TOML files (plain data, never executed); `--key=value` overrides from the command line, type- and
range-checked against the dataclass. Every program in `purejax.train` is configured this way.

    @dataclass(frozen=True)
    class Settings:
        lr: float = setting(1e-3, "the peak learning rate", above=0)
        steps: int = setting(100, "optimizer steps", at_least=1)

        def __post_init__(self):
            check_ranges(self)        # so a bad value fails before anything compiles

    cfg = parse_args(Settings, ["--config=my.toml", "--steps=200"])

Precedence: the dataclass defaults, then the preset, then the overrides. An unknown key (listing the valid ones),
a value of the wrong type, out of range or refused by its `check` is a one-line error naming the key. `--help` and
docs/train-gpt.md's table (a test compares) come from the dataclass; nanoGPT `exec`s Python files instead."""

import dataclasses
import importlib
import math
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

PRESETS = Path(__file__).resolve().parent / "config"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


# ---------------------------------------------------------------- declaring settings


@dataclasses.dataclass(frozen=True)
class Range:
    """Where a number may lie: `at_least`/`at_most` are inclusive bounds, `above`/`below` exclusive."""

    at_least: float | None = None
    at_most: float | None = None
    above: float | None = None
    below: float | None = None

    def holds(self, x: float) -> bool:
        low = (self.at_least is None or x >= self.at_least) and (self.above is None or x > self.above)
        return low and (self.at_most is None or x <= self.at_most) and (self.below is None or x < self.below)

    def __str__(self) -> str:
        bounds = [(">=", self.at_least), (">", self.above), ("<=", self.at_most), ("<", self.below)]
        return " and ".join(f"{op} {_number(b)}" for op, b in bounds if b is not None)


def setting(default: Any, help: str, check: Callable[[Any], Any] | None = None, **bounds: float) -> Any:
    """A dataclass field with its line of `help`, for numbers its range (`Range`), and a `check(value)` that raises
    ValueError for a value its type allows but a program cannot use; `check_ranges` applies both."""
    return dataclasses.field(default=default, metadata={"help": help, "range": Range(**bounds), "check": check})


def check_ranges(settings: Any) -> None:
    """Raise ConfigError for the first field of the dataclass `settings` whose value lies outside its range or
    fails its `check`; a float must also be finite (NaN or infinity is never a setting)."""
    for field in dataclasses.fields(settings):
        value, limits = getattr(settings, field.name), field.metadata.get("range", Range())
        if (check := field.metadata.get("check")) is not None:
            try:
                check(value)
            except ValueError as e:
                raise ConfigError(f"{field.name}={value!r}: {e}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{field.name}={value}: must be a finite number")
        if not limits.holds(value):
            raise ConfigError(f"{field.name}={_number(value)}: must be {limits}")


def check_schedule(settings: Any) -> None:
    """The rules of a warmup-then-cosine schedule (fields `warmup_iters`, `lr_decay_iters`, `learning_rate`,
    `min_lr`), each broken one a one-line ConfigError saying what to set."""
    warmup, decay = settings.warmup_iters, settings.lr_decay_iters
    if warmup >= decay:
        raise ConfigError(f"warmup_iters={warmup} must be less than lr_decay_iters={decay} (the cosine decay follows "
                          "the warmup): set a smaller --warmup_iters or a larger --lr_decay_iters")  # fmt: skip
    if settings.min_lr > settings.learning_rate:
        raise ConfigError(f"min_lr={settings.min_lr:g} exceeds learning_rate={settings.learning_rate:g}: the "
                          "schedule decays to min_lr; set --min_lr at most learning_rate")  # fmt: skip


def _number(x: float) -> str:
    return f"2**{int(x).bit_length() - 1}" if isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0 else f"{x:g}"


# ---------------------------------------------------------------- presets and values


def preset_path(name: str) -> Path:
    """A preset by name (`gpt_tiny` is purejax/train/config/gpt_tiny.toml) or by path to a .toml file."""
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        return path
    candidate = PRESETS / f"{name}.toml"
    if candidate.exists():
        return candidate
    raise ConfigError(f"no preset {name!r}: not a .toml file, and not one of {preset_names()} in {PRESETS}")


def preset_names(prefix: str = "") -> list[str]:
    return sorted(p.stem for p in PRESETS.glob(f"{prefix}*.toml"))


def load_preset(name: str) -> dict[str, Any]:
    path = preset_path(name)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"preset {path} is not valid TOML: {e}") from None


def _options(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union type (`int | None` -> (int, NoneType)), or the type itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _parse_value(key: str, text: str, annotation: Any) -> Any:
    """`text` from the command line converted to the field's type."""
    options = _options(annotation)
    if len(options) > 1:
        if text.lower() in ("none", "null") and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _parse_value(key, text, option)
            except ConfigError:
                pass
        raise ConfigError(f"--{key}={text}: expected {type_name(annotation)}")
    if annotation is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--{key}={text}: expected a boolean (true/false)")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            raise ConfigError(f"--{key}={text}: expected {annotation.__name__}") from None
    if annotation is str:
        return text
    if typing.get_origin(annotation) is typing.Literal:
        if text in typing.get_args(annotation):
            return text
        raise ConfigError(f"--{key}={text}: expected one of {list(typing.get_args(annotation))}")
    raise ConfigError(f"--{key}: fields of type {annotation} cannot be set from the command line")


def _check_value(key: str, value: Any, annotation: Any) -> Any:
    """A value from a preset file checked against the field's type (TOML already gives ints, floats, bools)."""
    if isinstance(value, str) and str not in _options(annotation):
        return _parse_value(key, value, annotation)
    for option in _options(annotation):
        if option is float and type(value) is int:
            return float(value)
        if isinstance(option, type) and type(value) is option:
            return value
        if typing.get_origin(option) is typing.Literal and value in typing.get_args(option):
            return value
    raise ConfigError(f"{key} = {value!r}: expected {type_name(annotation)}")


def type_name(annotation: Any) -> str:
    """`float`, `int | None`, `char|byte`: a field's type as the help and the docs show it."""
    names = []
    for option in _options(annotation):
        if typing.get_origin(option) is typing.Literal:
            names.append("|".join(map(str, typing.get_args(option))))
        else:
            names.append("None" if option is type(None) else getattr(option, "__name__", str(option)))
    return " | ".join(names)


# ---------------------------------------------------------------- building and parsing


def build(cls: type[T], values: dict[str, Any]) -> T:
    """`cls(**values)` with every key checked: unknown keys listed with the valid ones, types checked."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(k for k in values if k not in fields)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {sorted(fields)}")
    checked = {k: _check_value(k, v, hints[k]) for k, v in values.items()}
    return cls(**checked)


def parse_args(cls: type[T], argv: list[str], *, default_preset: str | None = None) -> T:
    """Build `cls` from `--config=<preset>` (or `default_preset`) and `--key=value` overrides (`--sp`: `--sp=true`)."""
    values: dict[str, Any] = {}
    overrides: list[tuple[str, str]] = []
    preset = default_preset
    hints = typing.get_type_hints(cls)
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" not in arg and hints.get(arg[2:]) is bool:
            arg = f"{arg}=true"
        if not arg.startswith("--") or "=" not in arg:
            hint = f"; write {arg}={argv[i + 1]}" if arg.startswith("--") and i + 1 < len(argv) else ""
            raise ConfigError(f"arguments look like --key=value, got {arg!r}{hint} (--help lists the settings)")
        key, _, text = arg[2:].partition("=")
        if key == "config":
            preset = text
        else:
            overrides.append((key, text))
    if preset is not None:
        values.update(load_preset(preset))
    for key, text in overrides:
        if key not in hints:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {sorted(hints)}")
        values[key] = _parse_value(key, text, hints[key])
    return build(cls, values)


def command_line(cls: type[T], argv: list[str], *, prog: str, doc: str = "", default_preset: str | None = None) -> T:
    """`parse_args` for the `main` of the program `prog` (e.g. "purejax.train.gpt"): `--help` (or `-h`) prints
    `help_text` and exits 0; a ConfigError exits with its one-line message instead of a traceback."""
    if "--help" in argv or "-h" in argv:
        preset = next((a.partition("=")[2] for a in argv if a.startswith("--config=")), default_preset)
        try:
            print(help_text(cls, preset, doc, prog))
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        raise SystemExit(0)
    try:
        return parse_args(cls, argv, default_preset=default_preset)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def explicit_keys(argv: list[str]) -> set[str]:
    """The settings given on the command line (`--key=value`), not counting `--config`."""
    return {a[2:].partition("=")[0] for a in argv if a.startswith("--")} - {"config"}


# ---------------------------------------------------------------- describing the settings


def describe(cls: type, preset: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(name, type, range, default, help) of each field, `preset` applied: `cls`'s own fields, then inherited."""
    values = load_preset(preset) if preset else {}
    hints = typing.get_type_hints(cls)
    inherited = {f.name for base in cls.__bases__ if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name in inherited)  # stable: each group keeps its order
    return [(f.name, type_name(hints[f.name]), str(f.metadata.get("range", "")), _shown(values.get(f.name, f.default)),
             f.metadata.get("help", "")) for f in fields]  # fmt: skip


def help_text(cls: type, preset: str | None = None, doc: str = "", prog: str = "") -> str:
    """What `--help` prints: the program's usage, the first paragraph of `doc`, and its settings, one line each."""
    summary = doc.strip().split("\n\n")[0]
    rows = describe(cls, preset)
    width = max(len(f"--{name}={kind}") for name, kind, *_ in rows)
    default_width = max(len(default) for *_, default, _ in rows)
    lines = [f"usage: python -m {prog or cls.__module__} [--config=PRESET] [--key=value ...]", "", summary, ""]
    if preset is not None:
        family = re.match(r"[a-z]*", Path(preset).stem).group()  # gpt_cpu -> the gpt* presets
        lines.append(f"Defaults with the preset {preset} applied (--config=NAME or a .toml path; presets: "
                     f"{', '.join(preset_names(family))}).")  # fmt: skip
    lines.append("Settings, as --key=value (type, default, meaning, range):")
    for name, kind, limits, default, text in rows:
        lines.append(f"  {f'--{name}={kind}':<{width}}  {default:<{default_width}}  {text}"
                     + (f" ({limits})" if limits else ""))  # fmt: skip
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else _number(value)


def markdown_table(cls: type, preset: str | None = None) -> str:
    """The settings of `cls` as a Markdown table (setting, type, default, range, meaning), for the docs."""
    lines = ["| setting | type | default | range | meaning |", "|---|---|---|---|---|"]
    for name, kind, limits, default, text in describe(cls, preset):
        cells = [f"`{name}`", f"`{kind}`", f"`{default}`", limits, text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m purejax.train.config purejax.train.gpt TrainConfig gpt_cpu: the docs' table
    module, name, *preset = sys.argv[1:]
    print(markdown_table(getattr(importlib.import_module(module), name), *preset))
