"""`python3 dev.py demo` samples from the directory its training run wrote, whichever preset chose it."""

import sys
from pathlib import Path

import dev

ROOT = Path(__file__).resolve().parent.parent


def test_demo_samples_from_the_out_dir_the_training_run_used(monkeypatch):
    ran = []
    monkeypatch.setattr(dev, "run", lambda args: ran.append(args) or 0)
    out_dir = dev.train_out_dir
    monkeypatch.setattr(dev, "train_out_dir", lambda args: out_dir(args, python=sys.executable))
    assert dev.demo(["--config=gpt_tiny", "--max_iters=5"]) == 0
    assert ran == [
        ["-m", "train.gpt", "--config=gpt_tiny", "--max_iters=5"],
        ["-m", "train.sample", "--out_dir=out-gpt-tiny", "--num_samples=1"],
    ]
    assert out_dir(["--config=gpt_tiny", "--out_dir=elsewhere"], python=sys.executable) == "elsewhere"
    assert out_dir([], python=sys.executable) == "out-gpt"
    assert out_dir(["--no_such_key=1"], python=sys.executable) is None
    ran.clear()
    assert dev.demo(["--no_such_key=1"]) == 2 and ran == []  # the parser said why; nothing was run


def test_docs_builds_strictly_with_the_docs_extra_and_serves(monkeypatch):
    """`python3 dev.py docs` installs the docs extra and runs the strict build; `docs serve ARGS` serves."""
    installed, ran = [], []
    monkeypatch.setattr(dev, "ensure_venv", installed.append)
    monkeypatch.setattr(dev, "run", lambda args: ran.append(args) or 0)
    assert dev.main(["docs"]) == 0
    assert dev.main(["docs", "serve", "--dev-addr=127.0.0.1:8001"]) == 0
    assert installed == ["docs", "docs"]
    assert ran == [["-m", "mkdocs", "build", "--strict"], ["-m", "mkdocs", "serve", "--dev-addr=127.0.0.1:8001"]]
    assert (ROOT / "mkdocs.yml").exists()


def test_the_suite_runs_a_worker_per_core_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 2)
    assert dev.test_workers(["-k", "gpt"]) == ["-n", "2", "--dist", "loadfile"]
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 64)
    assert dev.test_workers([]) == ["-n", "4", "--dist", "loadfile"]  # at most 4: each may start 8-device children
    assert dev.test_workers(["-n", "0"]) == [] and dev.test_workers(["--dist=no"]) == []
