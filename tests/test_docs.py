"""Every ```python block in README.md and docs/ runs, so the documentation cannot rot.

The blocks of one file run in order in one namespace (a page is one session, as a reader would type it).
Blocks fenced as anything else (```text, ```bash) are not run.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block in `page`."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    namespace = {"__name__": f"doc:{page.name}"}
    for line, code in python_blocks(page):
        compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        exec(compiled, namespace)


def test_blocks_are_found(tmp_path):
    """The extractor itself: a page with two python blocks and a text block yields exactly the two."""
    page = tmp_path / "page.md"
    page.write_text("x\n```python\na = 1\n```\n```text\nno\n```\n```python\nb = a + 1\n```\n")
    assert python_blocks(page) == [(3, "a = 1\n"), (9, "b = a + 1\n")]
