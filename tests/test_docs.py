"""Every ```python block in README.md and docs/ runs, so the documentation cannot rot.

The blocks of one file run in order in one namespace (a page is one session, as a reader would type it).
Blocks fenced as anything else (```text, ```bash) are not run.

Snippets of another library (the migration pages' PyTorch and Flax sides) name the module they need as
the fence's first class, e.g. ```python {.torch title="PyTorch"} (attribute-list syntax, which the docs site
renders as Python code with a title and GitHub as plain Python). They run only where that module imports:
the page is run a second time, its plain blocks and those peer blocks in page order, as a test of its own
named `page[peer]`, which is reported as a skip with the reason where the module is missing (the peers are
in the bench extra, not in the test venv). Peer blocks may use what the plain blocks define, never the
reverse.

A page that needs a fresh JAX (several simulated CPU devices: XLA reads `XLA_FLAGS` once, when JAX first
starts, and in this process it started long ago with one device) says so in an HTML comment on a line of its
own (under the title: the docs site takes the page's title from a first-line heading), which the site does not
render:

    <!-- docs-test: fresh-process XLA_FLAGS=--xla_force_host_platform_device_count=8 -->

A page whose examples train for hundreds of steps asks for XLA's optimizations back the same way
(`fresh-process JAX_DISABLE_MOST_OPTIMIZATIONS=0`): the suite compiles with most of them off (tests/conftest.py),
which costs such a loop more in its steps than it saves in compilation (docs/small-models.md; the figures
are in docs/benchmarks.md).

Its blocks then run in order, in one namespace, in a new Python process (this one's interpreter, the page's
variables added to the environment, cwd a temporary directory); a failure shows that process's output, with
each traceback naming the page and the block's first line as above.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
# ```python {.NAME ...}: a block that needs the importable module NAME (a peer library).
PEER_BLOCK = re.compile(
    r"^```python(?:[ \t]+\{\.([A-Za-z_]\w*)[^}\n]*\})?[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE
)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block in `page`."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def blocks_with_peer(page: Path, peer: str) -> list[tuple[int, str]]:
    """(first line number, code) of each plain ```python block and each ```python `peer` block, in page order."""
    text = page.read_text()
    matches = [m for m in PEER_BLOCK.finditer(text) if m.group(1) in (None, peer)]
    return [(text[: m.start()].count("\n") + 2, m.group(2)) for m in matches]


def peers(page: Path) -> list[str]:
    """The modules named by the page's ```python {.NAME} blocks, in order of first use."""
    return list(dict.fromkeys(m.group(1) for m in PEER_BLOCK.finditer(page.read_text()) if m.group(1)))


# <!-- docs-test: fresh-process NAME=value ... --> on a line of a page: run it in a new process, so set.
FRESH = re.compile(r"^<!-- docs-test: fresh-process((?:[ \t]+\w+=\S+)*)[ \t]*-->$", re.MULTILINE)
FRESH_TIMEOUT = 300  # seconds; a page is meant to take ~15
RUNNER = """
import json, sys
namespace = {"__name__": sys.argv[2]}
for name, code in json.load(open(sys.argv[1])):
    exec(compile(code, name, "exec"), namespace)
"""


def fresh_environment(page: Path) -> dict[str, str] | None:
    """The variables a fresh-process page asks for (maybe none), or None for a page run in this process."""
    match = FRESH.search(page.read_text())
    return None if match is None else dict(item.split("=", 1) for item in match.group(1).split())


def run_fresh(page: Path, blocks: list[tuple[int, str]], environment: dict[str, str], cwd: Path) -> None:
    script = cwd / "blocks.json"
    script.write_text(json.dumps([(f"{page.relative_to(ROOT)}:{line}", code) for line, code in blocks]))
    env = {**os.environ, **environment, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if "XLA_FLAGS" in environment:  # the page's flags after the suite's own (tests/conftest.py)
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {environment['XLA_FLAGS']}".strip()
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), f"doc:{page.name}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert run.returncode == 0, f"{page.relative_to(ROOT)} failed in its own process:\n{run.stdout}\n{run.stderr}"


def run_blocks(page: Path, blocks: list[tuple[int, str]]) -> None:
    namespace = {"__name__": f"doc:{page.name}"}
    for line, code in blocks:
        compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        exec(compiled, namespace)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    environment = fresh_environment(page)
    if environment is None:
        run_blocks(page, python_blocks(page))
    else:
        run_fresh(page, python_blocks(page), environment, tmp_path)


PEER_CASES = [(page, peer) for page in PAGES for peer in peers(page)]


@pytest.mark.parametrize(("page", "peer"), PEER_CASES, ids=[f"{p.relative_to(ROOT)}[{peer}]" for p, peer in PEER_CASES])
def test_doc_page_runs_with_peer(page, peer, tmp_path, monkeypatch):
    if importlib.util.find_spec(peer.split(".")[0]) is None:
        pytest.skip(f"{peer} is not installed: the {peer} blocks of {page.relative_to(ROOT)} need the bench extra")
    monkeypatch.chdir(tmp_path)
    run_blocks(page, blocks_with_peer(page, peer))


def test_blocks_are_found(tmp_path):
    """The extractor itself: a page with two python blocks and a text block yields exactly the two."""
    page = tmp_path / "page.md"
    page.write_text("x\n```python\na = 1\n```\n```text\nno\n```\n```python\nb = a + 1\n```\n")
    assert python_blocks(page) == [(3, "a = 1\n"), (9, "b = a + 1\n")]


def test_peer_blocks_are_found(tmp_path):
    """A ```python {.torch} block is not a plain block; it runs, in page order, only in the page's torch run."""
    page = tmp_path / "page.md"
    torch_fence, flax_fence = '```python {.torch title="PyTorch"}', "```python {.flax}"
    blocks = ["```python\na = 1", f"{torch_fence}\nt = a", f"{flax_fence}\nf = a", "```python\nb = 2"]
    page.write_text("".join(block + "\n```\n" for block in blocks))
    assert python_blocks(page) == [(2, "a = 1\n"), (11, "b = 2\n")]
    assert peers(page) == ["torch", "flax"]
    assert blocks_with_peer(page, "torch") == [(2, "a = 1\n"), (5, "t = a\n"), (11, "b = 2\n")]
    assert blocks_with_peer(page, "flax") == [(2, "a = 1\n"), (8, "f = a\n"), (11, "b = 2\n")]


def test_fresh_process_pages(tmp_path):
    """A marked page runs in a new process with its variables (JAX there sees 3 devices); an unmarked one not."""
    plain, marked = tmp_path / "plain.md", tmp_path / "marked.md"
    plain.write_text("<!-- a comment -->\n```python\nx = 1\n```\n")
    marker = "# A page\n\n<!-- docs-test: fresh-process XLA_FLAGS=--xla_force_host_platform_device_count=3 -->\n"
    marked.write_text(marker + "```python\nimport jax\nn = jax.device_count()\n```\n```python\nassert n == 3\n```\n")
    assert fresh_environment(plain) is None
    environment = fresh_environment(marked)
    assert environment == {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    page = ROOT / "docs" / "probe.md"  # a name under ROOT, as a real page's: it only labels the tracebacks
    run_fresh(page, python_blocks(marked), environment, tmp_path)
    with pytest.raises(AssertionError, match=r"docs/probe.md:8\", line 1"):
        run_fresh(page, [*python_blocks(marked)[:1], (8, "assert n == 1\n")], environment, tmp_path)
