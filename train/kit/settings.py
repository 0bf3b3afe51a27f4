"""The settings of a training program: a frozen dataclass whose fields say their default, range and meaning;
presets as TOML files (plain data, never executed); `--key=value` overrides from the command line, type- and
range-checked against the dataclass. Every program in `train` is configured this way.

    @dataclass(frozen=True)
    class Settings:
        lr: float = setting(1e-3, "the peak learning rate", above=0)
        steps: int = setting(100, "optimizer steps", at_least=1)

        def __post_init__(self):
            check_ranges(self)        # so a bad value fails before anything compiles

    settings = parse_args(Settings, ["--config=my.toml", "--steps=200"])

Precedence: the dataclass defaults, then the preset, then the overrides. An unknown key (listing the valid ones),
a value of the wrong type, out of range or refused by its `check`, a setting given where it has no effect
(`applies=When(...)`) or contradicting another (`agrees=`, train/kit/rules.py) is a one-line error
naming the key. `--help` and docs/train-gpt.md's table (a test compares) come from the dataclass; nanoGPT `exec`s
Python files instead."""

import dataclasses
import importlib
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from train.kit import rules as rules_lib

# check_ranges and check_schedule too: the programs call them as settings_lib's
from train.kit.rules import ConfigError, Range, When, check_ranges, check_schedule, number  # noqa: F401

PRESETS = Path(__file__).resolve().parent.parent / "presets"
T = TypeVar("T")


# ---------------------------------------------------------------- declaring settings


def setting(
    default: Any,
    help: str,
    check: Callable[[Any], Any] | None = None,
    applies: When | None = None,
    agrees: Callable[[Any], None] | None = None,
    **bounds: float,
) -> Any:
    """A dataclass field with its line of `help`, for numbers its range (`Range`), and a `check(value)` that raises
    ValueError for a value its type allows but a program cannot use (`check_ranges` applies both); `applies`,
    when the setting has an effect, and `agrees(settings)`, its rule against the others (`build` checks both)."""
    metadata = {"help": help, "range": Range(**bounds), "check": check, "applies": applies, "agrees": agrees}
    return dataclasses.field(default=default, metadata=metadata)


def inherited(cls: type, name: str, default: Any) -> Any:
    """The setting `name` as the dataclass `cls` declares it (its help, range and rules), with another default:
    a program's settings extend the common ones and give some of them the program's own default.

        out_dir: str = inherited(TrainSettings, "out_dir", "out-flow")"""
    declared = {f.name: f for f in dataclasses.fields(cls)}[name]
    return dataclasses.field(default=default, metadata=declared.metadata)


# ---------------------------------------------------------------- presets and values


def preset_path(name: str) -> Path:
    """A preset by name (`gpt_tiny` is train/presets/gpt_tiny.toml) or by path to a .toml file."""
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


def build(cls: type[T], values: dict[str, Any], given: set[str] | None = None, *, rules: bool = True) -> T:
    """`cls(**values)` with every key checked: unknown keys listed with the valid ones, types checked; then,
    with `rules`, the rules between settings (`rules_lib.broken`: a setting in `given`, or when that is
    None one that differs from its default, where it has no effect; one contradicting another)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(k for k in values if k not in fields)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {sorted(fields)}")
    checked = {k: _check_value(k, v, hints[k]) for k, v in values.items()}
    settings = cls(**checked)
    if rules and (message := rules_lib.broken(settings, given)):
        raise ConfigError(message)
    return settings


def parse_args(cls: type[T], argv: list[str], *, default_preset: str | None = None) -> T:
    """Build `cls` from `--config=<preset>` (or `default_preset`) and `--key=value` overrides (`--sp`: `--sp=true`).
    The keys of both count as given (`build`); with `--init_from=resume` the settings not given come from the
    checkpoint, so the rules between settings wait until `resume.settings` has merged them."""
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
    return build(cls, values, given=set(values), rules=values.get("init_from") != "resume")


def command_line(cls: type[T], argv: list[str], *, prog: str, doc: str = "", default_preset: str | None = None) -> T:
    """`parse_args` for the `main` of the program `prog` (e.g. "train.gpt"): `--help` (or `-h`) prints
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
    """(name, type, range, default, help) of each field, `preset` applied, in the order they are declared
    (a base's first), except those of the root dataclass `cls` extends (how a run is watched), which go last."""
    values = load_preset(preset) if preset else {}
    hints = typing.get_type_hints(cls)
    root = [c for c in cls.__mro__ if dataclasses.is_dataclass(c)][-1]
    last = {f.name for f in dataclasses.fields(root)} if root is not cls else set()
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name in last)  # stable: each group keeps its order
    return [
        (
            f.name,
            type_name(hints[f.name]),
            str(f.metadata.get("range", "")),
            _shown(values.get(f.name, f.default)),
            _meaning(f),
        )
        for f in fields
    ]


def _meaning(field: dataclasses.Field) -> str:
    """A field's help, and when it has an effect (`applies`)."""
    when = field.metadata.get("applies")
    return field.metadata.get("help", "") + (f"; only with {when}" if when else "")


def help_text(cls: type, preset: str | None = None, doc: str = "", prog: str = "") -> str:
    """What `--help` prints: the program's usage, the first paragraph of `doc`, and its settings, one line each."""
    summary = doc.strip().split("\n\n")[0]
    rows = describe(cls, preset)
    width = max(len(f"--{name}={kind}") for name, kind, *_ in rows)
    default_width = max(len(default) for *_, default, _ in rows)
    lines = [f"usage: python -m {prog or cls.__module__} [--config=PRESET] [--key=value ...]", "", summary, ""]
    if preset is not None:
        family = re.match(r"[a-z]*", Path(preset).stem).group()  # gpt_cpu -> the gpt* presets
        lines.append(
            f"Defaults with the preset {preset} applied (--config=NAME or a .toml path; presets: "
            f"{', '.join(preset_names(family))})."
        )
    lines.append("Settings, as --key=value (type, default, meaning, range):")
    for name, kind, limits, default, text in rows:
        lines.append(
            f"  {f'--{name}={kind}':<{width}}  {default:<{default_width}}  {text}" + (f" ({limits})" if limits else "")
        )
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else number(value)


def markdown_table(cls: type, preset: str | None = None) -> str:
    """The settings of `cls` as a Markdown table (setting, type, default, range, meaning), for the docs."""
    lines = ["| setting | type | default | range | meaning |", "|---|---|---|---|---|"]
    for name, kind, limits, default, text in describe(cls, preset):
        cells = [f"`{name}`", f"`{kind}`", f"`{default}`", limits, text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m train.kit.settings train.gpt GPTSettings gpt_cpu: the docs' table
    module, name, *preset = sys.argv[1:]
    print(markdown_table(getattr(importlib.import_module(module), name), *preset))
