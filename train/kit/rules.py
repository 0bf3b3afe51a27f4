"""The rules a program's settings follow (`train.kit.settings` declares them and checks them with these):

- each value on its own, in the dataclass's `__post_init__` (`check_ranges`): its type's range (`Range`), its
  `check`, and finite floats;
- each setting against the others, once all are known (`broken`, from `config.build`):

    muon_ns_steps: int = setting(5, "...", applies=When("optimizer", "muon"))
    shampoo_start: int = setting(10, "...", applies=When("optimizer", "shampoo"), agrees=starts_in_the_run)

  `applies`: a setting given (on the command line or in the preset) where it has no effect is refused, naming it
  and what it needs: `--muon_ns_steps=7 --optimizer=adamw` would otherwise run AdamW as if the 7 had been read,
  and whoever meant `--optimizer=muon` would never learn it. `agrees(settings)` raises ValueError when the
  value contradicts another setting (Shampoo's first preconditioned step past the run's last one); it is
  checked only where the setting applies.

The second kind waits for all the settings: on a resume those not given come from the checkpoint, and a rule
checked against the defaults before would refuse a run that is fine.
"""

import dataclasses
import math
from collections.abc import Collection
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


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
        return " and ".join(f"{op} {number(b)}" for op, b in bounds if b is not None)


@dataclasses.dataclass(frozen=True)
class When:
    """The condition under which a setting has an effect: the setting `key` equal to `value`
    (`When("optimizer", "muon")`), or, with `above`, greater than it (`When("n_experts", above=0)`)."""

    key: str
    value: Any = None
    above: float | None = None

    def holds(self, settings: Any) -> bool:
        now = getattr(settings, self.key)
        return now > self.above if self.above is not None else now == self.value

    def __str__(self) -> str:
        if self.above is not None:
            return f"--{self.key} > {number(self.above)}"
        return f"--{self.key}={shown(self.value)}"


def number(x: float) -> str:
    """A bound or value as the errors and the help show it: `0.001`, `1000000` (an int as typed, never `1e+06`),
    `2**32` for a large power of two."""
    if isinstance(x, int) and not isinstance(x, bool):
        return f"2**{x.bit_length() - 1}" if x >= 2**20 and x & (x - 1) == 0 else str(x)
    return f"{x:g}"


def shown(value: Any) -> str:
    """A value as it is written on the command line: `true`, `muon`, `0.5`."""
    return str(value).lower() if isinstance(value, bool) else str(value)


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
            raise ConfigError(f"{field.name}={number(value)}: must be {limits}")


def check_schedule(settings: Any) -> None:
    """The rules of a warmup-then-cosine schedule (fields `warmup_iters`, `lr_decay_iters`, `learning_rate`,
    `min_lr`), each broken one a one-line ConfigError saying what to set."""
    warmup, decay = settings.warmup_iters, settings.lr_decay_iters
    if warmup >= decay:
        raise ConfigError(
            f"warmup_iters={warmup} must be less than lr_decay_iters={decay} (the cosine decay follows "
            "the warmup): set a smaller --warmup_iters or a larger --lr_decay_iters"
        )
    if settings.min_lr > settings.learning_rate:
        raise ConfigError(
            f"min_lr={settings.min_lr:g} exceeds learning_rate={settings.learning_rate:g}: the "
            "schedule decays to min_lr; set --min_lr at most learning_rate"
        )


def broken(settings: Any, given: Collection[str] | None = None) -> str | None:
    """The first rule between settings that the dataclass `settings` breaks, as a one-line message, or None. A
    setting counts as given when its name is in `given`, or, when `given` is None (settings merged from a
    checkpoint, where what was typed is unknown), when its value differs from its default."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        when, agrees = field.metadata.get("applies"), field.metadata.get("agrees")
        if when is not None and not when.holds(settings):
            named = field.name in given if given is not None else value != field.default
            if named:
                return f"--{field.name} applies only with {when} (it is {shown(getattr(settings, when.key))})"
            continue
        if agrees is not None:
            try:
                agrees(settings)
            except ValueError as e:
                return f"{field.name}={value!r}: {e}"
    return None
