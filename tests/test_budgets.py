"""The reading budgets a reference implementation keeps: no source file in `purejax/`, `models/` or `train/` over
300 lines, no function over 60 lines of code (docstrings, comments and blank lines not counted), and the GPT
on a page of about 250. Code is laid out by the formatter, not packed to fit: at most 20 lines in the tree opt
out of it with an opt-out comment for the formatter, each saying why.

These are limits on what a reader has to hold in their head at once, checked here so they cannot erode quietly."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for part in ("purejax", "models", "train") for p in (ROOT / part).rglob("*.py"))
MAX_FILE_LINES = 300
MAX_FUNCTION_CODE_LINES = 60
PAGES = {"models/gpt.py": 250}  # "about 250", like nanoGPT's model.py


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code: not blank, not only a comment, not part of a docstring."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            lines.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            if isinstance(body[0].value.value, str):
                lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def long_functions(path: Path) -> list[str]:
    source = path.read_text()
    code = code_lines(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = len(code & set(range(node.lineno, node.end_lineno + 1)))
            if n > MAX_FUNCTION_CODE_LINES:
                found.append(f"{node.name} (line {node.lineno}): {n} code lines")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_file_fits_the_budgets(path):
    name = str(path.relative_to(ROOT))
    n_lines = len(path.read_text().splitlines())
    limit = PAGES.get(name, MAX_FILE_LINES)
    assert n_lines <= limit, f"{name} has {n_lines} lines, over its budget of {limit}: split it by idea"
    assert not long_functions(path), (
        f"{name}: functions over {MAX_FUNCTION_CODE_LINES} code lines: {long_functions(path)}"
    )


def test_the_counter_counts_code_only():
    source = 'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = (x +\n         1)\n    return y\n'
    assert sorted(code_lines(source)) == [1, 6, 7, 8]


MAX_FORMATTER_OPT_OUTS = 20
OPT_OUT = "# fmt" + ": skip"  # spelled in two pieces so that this file does not count itself


def test_the_formatter_lays_out_the_code():
    """An opt-out is for a table whose columns mean something, with its reason: `<opt-out> - why`."""
    parts = ("purejax", "models", "train", "bench", "tests")
    tree = [ROOT / "dev.py", *(p for part in parts for p in (ROOT / part).rglob("*.py"))]
    opt_outs = {
        f"{path.relative_to(ROOT)}:{i}": line.split(OPT_OUT, 1)[1]
        for path in tree
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if OPT_OUT in line
    }
    assert len(opt_outs) <= MAX_FORMATTER_OPT_OUTS, f"{len(opt_outs)} lines opt out of the formatter: {list(opt_outs)}"
    unexplained = [where for where, rest in opt_outs.items() if not rest.startswith(" - ")]
    assert not unexplained, f"opt-outs of the formatter without their reason (`{OPT_OUT} - why`): {unexplained}"
