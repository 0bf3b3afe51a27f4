"""purejax: a small pure-functional deep-learning framework for JAX.

Models are pairs of pure functions, `init(key, config) -> params` and `apply(params, inputs, ...) -> outputs`,
over plain nested dicts of arrays. See docs/design.md for the contract and why.

Every subpackage of the framework is an attribute after `import purejax` (`purejax.optim.adamw(...)`), imported
on first use (PEP 562's module `__getattr__`), so `import purejax` itself loads nothing heavy. The reference
models and training programs are not part of the framework and are imported by name:
`from purejax.models import gpt`, `python -m purejax.train.gpt`.
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
_BY_NAME_ONLY = ("models", "train")  # the reference models and programs, outside the framework

__all__ = ["__version__", *SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets the attribute: later lookups skip this
    if name in _BY_NAME_ONLY:
        raise AttributeError(
            f"purejax.{name} is not loaded by `import purejax`: it holds the reference "
            f"{'models' if name == 'models' else 'training programs'}, which the framework never imports; "
            f"import it by name, e.g. `from purejax.{name} import {'gpt'}`"
        )
    raise AttributeError(f"module 'purejax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *SUBPACKAGES})
