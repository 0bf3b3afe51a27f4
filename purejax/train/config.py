"""Configuration for training programs: a frozen dataclass of settings, presets as TOML files (plain data,
never executed), and `--key=value` overrides from the command line, type-checked against the dataclass.

    config = parse_args(TrainConfig, ["--config=gpt_tiny", "--max_iters=200", "--compile=false"])

Order of precedence: the dataclass defaults, then the preset, then the overrides. An unknown key is an
error that lists the valid keys; a value that does not parse as the field's type is an error that names
the key, the value and the type. This replaces nanoGPT's `exec`-based configurator.
"""

import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

PRESETS = Path(__file__).resolve().parent / "config"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


def preset_path(name: str) -> Path:
    """A preset by name (`gpt_tiny` is purejax/train/config/gpt_tiny.toml) or by path to a .toml file."""
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        return path
    candidate = PRESETS / f"{name}.toml"
    if candidate.exists():
        return candidate
    available = sorted(p.stem for p in PRESETS.glob("*.toml"))
    raise ConfigError(f"no preset {name!r}: not a .toml file, and not one of {available} in {PRESETS}")


def load_preset(name: str) -> dict[str, Any]:
    with open(preset_path(name), "rb") as f:
        return tomllib.load(f)


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
        raise ConfigError(f"--{key}={text}: expected {annotation}")
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
    raise ConfigError(f"{key} = {value!r}: expected {annotation}")


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
    """Build `cls` from `--config=<preset>` (or `default_preset`) and `--key=value` overrides."""
    values: dict[str, Any] = {}
    overrides: list[tuple[str, str]] = []
    preset = default_preset
    hints = typing.get_type_hints(cls)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"arguments look like --key=value, got {arg!r}")
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


def explicit_keys(argv: list[str]) -> set[str]:
    """The settings given on the command line (`--key=value`), not counting `--config`."""
    return {a[2:].partition("=")[0] for a in argv if a.startswith("--")} - {"config"}


def resume_settings(cfg: Any, saved: dict[str, Any], given: Iterable[str], fixed: Iterable[str]) -> dict[str, Any]:
    """The settings of a resumed run: the checkpoint's (`saved`), then those of `cfg` named in `given` (the
    overrides given now, e.g. a longer run). An override of a key in `fixed` (the model, the data, what a
    step means) that differs from the checkpoint raises ConfigError naming every such key: a checkpoint cannot
    continue as another architecture or on other data."""
    given = set(given)
    conflicts = [f"{k}: checkpoint has {saved[k]!r}, override says {getattr(cfg, k)!r}"
                 for k in fixed if k in given and k in saved and saved[k] != getattr(cfg, k)]  # fmt: skip
    if conflicts:
        raise ConfigError("the overrides conflict with the checkpoint being resumed:\n  " + "\n  ".join(conflicts))
    return {**saved, **{k: getattr(cfg, k) for k in given}, "init_from": "resume", "out_dir": cfg.out_dir}
