"""The commands a `pip install` of purejax puts on the PATH (pyproject.toml's `[project.scripts]`):

    purejax-train-gpt       python -m purejax.train.gpt
    purejax-sample          python -m purejax.train.sample
    purejax-train-flow      python -m purejax.train.flow
    purejax-train-classify  python -m purejax.train.classify
    purejax-train-mlp       python -m purejax.train.mlp
    purejax-finetune        python -m purejax.train.finetune

Each program's `main(argv=None)` returns what it computed, for tests and notebooks; a command must return an
exit status instead (the script pip writes calls `sys.exit(command())`, and `sys.exit` of a dict prints it and
exits 1). So each command here runs its program and returns 0; a program that fails exits non-zero from inside
`main`, with its message. A program is imported only when its command runs.
"""

import importlib


def _run(program: str) -> int:
    importlib.import_module(f"purejax.train.{program}").main()
    return 0


def train_gpt() -> int:
    return _run("gpt")


def sample() -> int:
    return _run("sample")


def train_flow() -> int:
    return _run("flow")


def train_classify() -> int:
    return _run("classify")


def train_mlp() -> int:
    return _run("mlp")


def finetune() -> int:
    return _run("finetune")
