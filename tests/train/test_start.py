"""The kit's start of a run (`train.kit.start`) and the settings every program shares (`train.kit.train_settings`):
each common setting declared once, a program importing no other program, and `start.run` doing, in order, what
every `main` would otherwise repeat."""

import ast
import dataclasses
from pathlib import Path

import pytest

from train.classify_settings import ClassifySettings
from train.finetune_settings import FinetuneSettings
from train.flow_settings import FlowSettings
from train.gpt_settings import GPTSettings
from train.kit import observe, start
from train.kit.settings import inherited, setting
from train.kit.train_settings import TrainSettings

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {"gpt": GPTSettings, "classify": ClassifySettings, "flow": FlowSettings, "finetune": FinetuneSettings}


@pytest.mark.parametrize("settings_class", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_each_common_setting_is_declared_once(settings_class):
    """A program may give a common setting its own default (`inherited`), never its own help or range."""
    common = {f.name: f for f in dataclasses.fields(TrainSettings)}
    assert issubclass(settings_class, TrainSettings)
    for field in dataclasses.fields(settings_class):
        if field.name in common:
            assert dict(field.metadata) == dict(common[field.name].metadata), field.name


def test_inherited_keeps_the_help_and_range_and_changes_the_default():
    @dataclasses.dataclass(frozen=True)
    class Base:
        steps: int = setting(10, "optimizer steps", at_least=1)

    @dataclasses.dataclass(frozen=True)
    class Program(Base):
        steps: int = inherited(Base, "steps", 20)

    (field,) = dataclasses.fields(Program)
    assert Program().steps == 20 and field.metadata["help"] == "optimizer steps"
    assert str(field.metadata["range"]) == ">= 1"


def imported_train_modules(path: Path) -> set[str]:
    """The modules of `train` a file imports, by their name below it: `from train.kit import loop` is "kit"."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "train":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("train."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("train.")}
    return found


def test_no_program_imports_another():
    """A program's own modules are `train/<name>.py`, `train/<name>_*.py` and the parts named below; what two
    programs share lives in `train/kit/` (and the data pipeline in `train/data/`)."""
    parts = {"classify": {"confusion"}, "flow": {"sample_quality"}}
    for name in [*PROGRAMS, "mlp"]:
        for path in [ROOT / "train" / f"{name}.py", *(ROOT / "train").glob(f"{name}_*.py")]:
            own = {"kit", "data", *parts.get(name, ())}
            others = {m for m in imported_train_modules(path) if m not in own and m.split("_")[0] != name}
            assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}, another program's"


def test_the_kit_imports_no_program():
    for path in (ROOT / "train" / "kit").glob("*.py"):
        assert imported_train_modules(path) <= {"kit", "data"}, path.name


def test_start_run_parses_prepares_out_dir_and_starts_the_observer(tmp_path):
    argv = [f"--out_dir={tmp_path / 'out'}", "--max_iters=3", "--compile_cache=off"]
    with start.run(FlowSettings, argv, program="train.flow", doc=__doc__, default_preset="flow_tiny") as run:
        assert run.settings.max_iters == 3 and run.settings.out_dir == str(tmp_path / "out")
        assert run.out_dir.is_dir() and run.manager.directory == run.out_dir and run.main
        assert run.saved_config() is None  # not resuming
        assert isinstance(run.observer, observe.Observer) and run.observer.out_dir == run.out_dir


def test_start_run_help_exits_zero_naming_the_program(capsys):
    with pytest.raises(SystemExit) as e, start.run(FinetuneSettings, ["--help"], program="train.finetune", doc=""):
        pass
    assert e.value.code == 0 and "python -m train.finetune" in capsys.readouterr().out
