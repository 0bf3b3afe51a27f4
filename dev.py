"""The two quick-start commands, with their own set-up: `python3 dev.py demo` and `python3 dev.py test`.

Needs only python3 (3.11 or newer) with pip and venv. The first run creates `.venv/` beside this file and
installs the project with its extras into it; later runs reuse it, and reinstall only when `pyproject.toml`
changes. Nothing outside `.venv/` is touched.

    python3 dev.py demo [ARGS...]    train the default GPT, then sample from it (ARGS go to train.gpt)
    python3 dev.py test [ARGS...]    run the whole test suite, a worker per core (ARGS go to pytest)
    python3 dev.py bench [NAME]      run a benchmark from bench/ (installs the bench extra)
    python3 dev.py docs [ARGS...]    build the documentation site into build/site/, strict (installs the docs extra)
    python3 dev.py docs serve        serve it at http://127.0.0.1:8000, rebuilt on every edit
"""

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _stamp(extras: str) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return f"{digest}:{extras}"


def ensure_venv(extras: str) -> None:
    """Create `.venv` and install the project with `extras`, unless the stamp says it is already done."""
    stamp_file = VENV / "purejax-install.stamp"
    if stamp_file.exists() and _stamp(extras) in stamp_file.read_text().split():
        return
    if not PYTHON.exists():
        print(f"[dev] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
        subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    print(f"[dev] installing purejax[{extras}] into {VENV} (first run only; a few minutes)", flush=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "-e", f".[{extras}]"], cwd=ROOT, check=True)
    old = stamp_file.read_text().split() if stamp_file.exists() else []
    stamp_file.write_text("\n".join([*old, _stamp(extras)]) + "\n")


def run(args: list[str]) -> int:
    return subprocess.run([str(PYTHON), *args], cwd=ROOT).returncode


def train_out_dir(args: list[str], python: str | Path = PYTHON) -> str | None:
    """The out_dir that `train.gpt` with `args` trains into (the preset's unless --out_dir is given),
    asked of the program's own parser, so that the demo samples from the model it just trained. None when the
    arguments are wrong (the parser has printed why)."""
    code = "import sys; from train import gpt; print(gpt.parse(sys.argv[1:]).out_dir)"
    done = subprocess.run([str(python), "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def demo(args: list[str]) -> int:
    """Train a GPT with `args`, then sample from the directory that run wrote."""
    if "--help" in args or "-h" in args:
        return run(["-m", "train.gpt", *args])
    out_dir = train_out_dir(args)
    if out_dir is None:
        return 2
    return run(["-m", "train.gpt", *args]) or run(["-m", "train.sample", f"--out_dir={out_dir}", "--num_samples=1"])


def test_workers(args: list[str]) -> list[str]:
    """pytest-xdist's options for the suite: one worker per core (at most 4), each test file whole on one
    worker (`loadfile`: a file's module fixtures, such as the 8-device child runs, are made once; the docs
    pages, which share nothing, a unit each, and the slowest files first: tests/conftest.py). Most of the
    suite's time is XLA compiling on one thread, so two cores halve it; a third worker on two cores made the
    whole suite slower. None when `args` choose for themselves (`-n 0` runs in this process, for a
    debugger)."""
    if any(a == "-n" or a.startswith(("-n", "--numprocesses", "--dist")) for a in args):
        return []
    return ["-n", str(min(4, os.cpu_count() or 1)), "--dist", "loadfile"]


def docs(args: list[str]) -> int:
    """`mkdocs build --strict` (mkdocs.yml): a broken link, a page missing from the nav or a docstring that does
    not render fails the build. `serve` instead serves the site and rebuilds it as the pages change."""
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # Material's banner about its successor, on every build
    if args[:1] == ["serve"]:
        return run(["-m", "mkdocs", "serve", *args[1:]])
    return run(["-m", "mkdocs", "build", "--strict", *args])


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "demo":
        ensure_venv("test,examples")
        return demo(rest)
    if command == "test":
        ensure_venv("test,examples")
        return run(["-m", "pytest", *test_workers(rest), *rest])
    if command == "bench":
        ensure_venv("test,examples,bench")
        name = rest[0] if rest else "nn"
        return run(["-m", f"bench.{name}", *rest[1:]])
    if command == "docs":
        ensure_venv("docs")
        return docs(rest)
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
