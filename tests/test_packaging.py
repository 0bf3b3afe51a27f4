"""What the wheel holds, checked from the checkout in a second (CI's `wheel` step, .ci/run, builds and installs
the real wheel and runs a user's script with it from an empty directory).

The wheel is the framework alone: the packages setuptools finds under pyproject.toml's rule are `purejax` and
its subpackages, never `models` or `train`, which are run from a checkout (`python -m train.gpt`).
"""

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_holds_purejax_alone():
    rule = PROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=rule["include"])
    assert "purejax" in packages and "purejax.nn" in packages
    assert all(p == "purejax" or p.startswith("purejax.") for p in packages), packages


def test_no_commands_are_installed():
    """The programs are not commands on a user's PATH: they live in the checkout's train/."""
    assert "scripts" not in PROJECT["project"]


def test_the_three_parts_sit_at_the_top_level():
    for part in ("purejax", "models", "train", "tests", "docs", "bench"):
        assert (ROOT / part).is_dir(), part
    assert not (ROOT / "purejax" / "models").exists() and not (ROOT / "purejax" / "train").exists()
