"""What an installed purejax needs, checked from the checkout in a second (CI's `wheel` step, .ci/run, builds and
installs the real wheel and runs the commands from an empty directory).

pyproject.toml's commands must name callables that run their program and return an exit status; every preset
must be package data; the distribution must hold the one top-level package `purejax`.
"""

import importlib
import tomllib
from pathlib import Path

import pytest

from purejax.train import cli
from purejax.train import config as config_lib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PROJECT["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_command_runs_its_program_and_returns_0(name, monkeypatch):
    """`sys.exit(command())` is what pip's script does: a dict returned by main would print it and exit 1."""
    program = f"purejax.train.{name.removeprefix('purejax-').removeprefix('train-')}"
    assert callable(importlib.import_module(program).main)
    ran = []

    class Program:
        @staticmethod
        def main():
            return {"loss": 1.0}

    monkeypatch.setattr(cli.importlib, "import_module", lambda module: ran.append(module) or Program)
    module, function = SCRIPTS[name].split(":")
    assert module == cli.__name__
    assert getattr(cli, function)() == 0 and ran == [program]


def test_every_preset_is_package_data():
    patterns = PROJECT["tool"]["setuptools"]["package-data"]["purejax.train"]
    presets = sorted(config_lib.PRESETS.glob("*.toml"))
    assert presets, config_lib.PRESETS
    base = ROOT / "purejax" / "train"
    assert all(any(p.relative_to(base).match(pattern) for pattern in patterns) for p in presets), patterns


def test_one_top_level_package():
    assert PROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["purejax*"]
    assert not (ROOT / "models").exists() and not (ROOT / "train").exists()  # nothing left to shadow a user's own
