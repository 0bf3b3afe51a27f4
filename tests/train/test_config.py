"""One parser for every training program: presets plus typed `--key=value`, `--help` generated from the settings'
dataclass, every numeric range checked before anything compiles, and the docs' table of settings generated from
the same dataclass (so it cannot drift)."""

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from train import classify, flow, gpt, mlp, sample
from train.kit import settings as settings_lib
from train.kit.settings import ConfigError, check_ranges, setting

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = [
    (gpt.main, gpt.GPTSettings),
    (flow.main, flow.FlowSettings),
    (classify.main, classify.ClassifySettings),
    (mlp.main, mlp.MLPSettings),
    (sample.main, sample.SampleConfig),
]


@pytest.mark.parametrize("main, cls", PROGRAMS, ids=lambda x: getattr(x, "__module__", ""))
def test_every_program_answers_help_with_each_setting_its_type_default_and_help(main, cls, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m train.{main.__module__.rsplit('.', 1)[1]}")
    lines = {line.split()[0].partition("=")[0]: line for line in out.splitlines() if line.startswith("  --")}
    hints = typing.get_type_hints(cls)  # the program's own fields and the shared ones it inherits
    for field in dataclasses.fields(cls):
        line = lines[f"--{field.name}"]
        assert field.metadata["help"] in line and settings_lib.type_name(hints[field.name]) in line
    assert re.search(r"--learning_rate=float\s+0.001\s+the peak learning rate.*\(> 0\)", out) or cls not in (
        gpt.GPTSettings,
        flow.FlowSettings,
    )


def test_help_shows_the_chosen_presets_values(capsys):
    with pytest.raises(SystemExit):
        gpt.main(["--config=gpt2", "-h"])
    out = capsys.readouterr().out
    assert re.search(r"--n_layer=int\s+12\s", out) and "preset gpt2 applied" in out


@pytest.mark.parametrize(
    "parse, args, message",
    [
        (gpt.parse, ["--learning_rate=nan"], "learning_rate=nan: must be a finite number"),
        (gpt.parse, ["--learning_rate=-1"], "learning_rate=-1: must be > 0"),
        (gpt.parse, ["--grad_clip=-1"], "grad_clip=-1: must be >= 0"),
        (gpt.parse, ["--weight_decay=-1"], "weight_decay=-1: must be >= 0"),
        (gpt.parse, ["--beta2=1.5"], "beta2=1.5: must be >= 0 and < 1"),
        (gpt.parse, ["--min_lr=-1"], "min_lr=-1: must be >= 0"),
        (gpt.parse, ["--seed=1180591620717411303424"], "seed=2**70: must be >= 0 and < 2**32"),
        (gpt.parse, ["--dropout=1"], "dropout=1: must be >= 0 and < 1"),
        (gpt.parse, ["--peak_flops=inf"], "peak_flops=inf: must be a finite number"),
        (gpt.parse, ["--min_lr=0.1"], "min_lr=0.1 exceeds learning_rate=0.001"),
        # a plain user command: a shorter run whose schedule the preset's warmup would not fit
        (gpt.parse, ["--max_iters=50", "--lr_decay_iters=50"], "warmup_iters=100 must be less than lr_decay_iters=50"),
        (flow.main, ["--ema_decay=2"], "ema_decay=2: must be >= 0 and <= 1"),
        (flow.main, ["--label_dropout=5"], "label_dropout=5: must be >= 0 and <= 1"),
        (flow.main, ["--eval_guidance=1,-2"], "guidance scales must be >= 0"),
        (classify.main, ["--bn_momentum=-0.1"], "bn_momentum=-0.1: must be >= 0 and <= 1"),
        (mlp.main, ["--lr=0"], "lr=0: must be > 0"),
        (mlp.main, ["--hidden=128,x"], "expected positive widths"),
        (sample.main, ["--top_p=0"], "top_p=0: must be > 0 and <= 1"),
        (sample.main, ["--temperature=-1"], "temperature=-1: must be >= 0"),
    ],
)
def test_bad_numbers_are_one_line_errors_before_anything_compiles(parse, args, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(args)
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)
    assert "compiled" not in capsys.readouterr().out


def test_a_preset_is_checked_like_the_command_line(tmp_path):
    (tmp_path / "bad.toml").write_text("learning_rate = nan\n")
    with pytest.raises(SystemExit, match="learning_rate=nan: must be a finite number"):
        gpt.parse([f"--config={tmp_path / 'bad.toml'}"])


def test_ranges_hints_and_optional_values():
    @dataclass(frozen=True)
    class Settings:
        rate: float = setting(0.5, "a rate", above=0, at_most=1)
        count: int | None = setting(None, "a count", at_least=1)

        def __post_init__(self):
            check_ranges(self)

    assert settings_lib.parse_args(Settings, ["--count=none", "--rate=1"]) == Settings(1.0, None)
    assert settings_lib.parse_args(Settings, ["--count=3"]).count == 3
    for args, message in (
        (["--rate=1.5"], "rate=1.5: must be > 0 and <= 1"),
        (["--count=0"], "count=0: must be >= 1"),
        (["--count", "3"], "write --count=3"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            settings_lib.parse_args(Settings, args)
    assert not math.isnan(Settings().rate)


def test_a_bool_setting_may_be_given_bare():
    @dataclass(frozen=True)
    class Settings:
        sp: bool = setting(False, "a switch")
        count: int = setting(1, "a count")

    assert settings_lib.parse_args(Settings, ["--sp"]).sp is True
    assert settings_lib.parse_args(Settings, ["--sp=false"]).sp is False
    with pytest.raises(ConfigError, match=re.escape("write --count=3")):  # only bools go bare
        settings_lib.parse_args(Settings, ["--count", "3"])


@pytest.mark.parametrize("cls, preset", [(gpt.GPTSettings, "gpt_cpu"), (sample.SampleConfig, None)])
def test_train_gpt_md_lists_every_setting_as_generated_from_the_dataclass(cls, preset):
    """docs/train-gpt.md, which the README calls the list of all training flags, holds the very table the
    dataclass generates: regenerate it with `python -m train.kit.settings <module> <class> [preset]`."""
    table = settings_lib.markdown_table(cls, preset)
    assert table in (ROOT / "docs" / "train-gpt.md").read_text(), (
        f"docs/train-gpt.md is out of date; its table of {cls.__name__} should read:\n{table}"
    )
    assert table.count("\n") == len(dataclasses.fields(cls)) + 1
