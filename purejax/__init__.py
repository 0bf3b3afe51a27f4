"""purejax: a small pure-functional deep-learning framework for JAX.

Models are pairs of pure functions, `init(key, config) -> params` and `apply(params, inputs, ...) -> outputs`,
over plain nested dicts of arrays. See docs/design.md for the contract and why.

Every subpackage of the framework is an attribute after `import purejax` (`purejax.optim.adamw(...)`), imported
on first use (PEP 562's module `__getattr__`), so `import purejax` itself loads nothing heavy. The reference
models (`models/`) and the training programs (`train/`) are not part of the framework: they sit beside it in a
checkout and run from there (`from models import gpt`, `python -m train.gpt`); the wheel installs `purejax` alone.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

SUBPACKAGES = (
    "checkpoint",
    "lora",
    "losses",
    "nn",
    "optim",
    "parallel",
    "precision",
    "random",
    "safetensors",
    "sampling",
    "tree",
)
_OUTSIDE = ("models", "train")  # the reference models and the programs: top-level folders of a checkout

__all__ = ["__version__", *SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets the attribute: later lookups skip this
    if name in _OUTSIDE:
        raise AttributeError(
            f"purejax has no {name}: the reference {'models' if name == 'models' else 'training programs'} "
            f"are the top-level `{name}` folder of a purejax checkout, outside the framework (which never "
            f"imports them); from the checkout's root, `from {name} import gpt`"
        )
    raise AttributeError(f"module 'purejax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *SUBPACKAGES})
