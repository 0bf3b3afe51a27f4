"""`import purejax`: every framework subpackage is an attribute, imported on first use; the reference models and
programs are not part of it, and asking for them says where they are."""

import subprocess
import sys
from pathlib import Path

import purejax

PACKAGE = Path(purejax.__file__).parent


def test_every_framework_subpackage_is_listed():
    found = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    framework = {name for name in found if not name.startswith("_")}
    assert framework == set(purejax.SUBPACKAGES)


def test_subpackages_load_on_first_use_and_models_and_train_are_not_among_them():
    script = """
import sys
import purejax
assert not [m for m in sys.modules if m.startswith("purejax.")], sorted(sys.modules)
for name in purejax.SUBPACKAGES:
    assert getattr(purejax, name).__name__ == "purejax." + name
assert purejax.optim.adamw and purejax.checkpoint.save and purejax.parallel.sharded_train_step
for name in ("models", "train"):
    try:
        getattr(purejax, name)
    except AttributeError as e:
        assert f"the top-level `{name}` folder of a purejax checkout" in str(e), e
    else:
        raise AssertionError(f"purejax.{name} loaded by attribute access")
assert not [m for m in sys.modules if m.startswith(("models", "train"))]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
