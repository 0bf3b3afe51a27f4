"""The documentation site (mkdocs.yml) can be reached in full: every public module has an API page, every page
is in the site's navigation and linked from the front page, and every docstring is read as the prose it is.

`python3 dev.py docs` (strict) checks the links and references that exist; these checks catch what is missing,
and run with the suite, where mkdocs is not installed (the docstring check needs griffe, from the docs extra:
`.ci/run docs` runs this file again after the build). The browser check of the built site is .ci/check_site.py.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PARTS = ("purejax", "models", "train")  # the framework, the reference models, the programs
DIRECTIVE = re.compile(r"^::: ([\w.]+)[ \t]*$", re.MULTILINE)


def public_modules() -> set[str]:
    """Dotted names of the modules and packages of purejax, models and train, less those whose name or folder
    starts with `_` (private, and `__main__`, which only runs)."""
    names = set()
    for path in (p for top in PARTS for p in (ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return names


def documented_modules() -> dict[str, list[str]]:
    """Each module a `::: name` directive in docs/api/ renders, and the pages that render it."""
    found: dict[str, list[str]] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for name in DIRECTIVE.findall(page.read_text()):
            found.setdefault(name, []).append(page.name)
    return found


def pages() -> set[str]:
    return {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}


def test_every_public_module_has_an_api_page():
    documented = documented_modules()
    missing = sorted(public_modules() - set(documented))
    assert not missing, (
        f"public modules with no API page: {missing}; add a `::: <module>` line to the docs/api/*.md page of its "
        f"package (or a new page, listed in mkdocs.yml's nav and docs/index.md)"
    )
    assert {"purejax.optim.train_step", "purejax.nn.linear", "models.gpt"} <= set(documented)


def test_api_pages_name_only_real_modules_once():
    documented = documented_modules()
    unknown = sorted(set(documented) - public_modules())
    assert not unknown, f"docs/api/ renders modules that do not exist or are private: {unknown}"
    twice = {name: where for name, where in documented.items() if len(where) > 1}
    assert not twice, f"modules rendered on more than one API page (their anchors would clash): {twice}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    listed = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w./-]+\.md)\s*(?:#.*)?$", nav, re.MULTILINE))
    assert listed <= pages(), f"mkdocs.yml's nav lists pages that do not exist: {sorted(listed - pages())}"
    assert not pages() - listed, (
        f"pages missing from mkdocs.yml's nav: {sorted(pages() - listed)}; add each where a reader looks for it "
        f"(Tutorial, Guides, API reference), and link it from docs/index.md"
    )


def test_the_front_page_links_every_page():
    linked = set(re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", (DOCS / "index.md").read_text()))
    unlinked = sorted(pages() - linked - {"index.md"})
    assert not unlinked, f"docs/index.md, the reading order, does not link to {unlinked}: add each where it belongs"


def test_docstrings_are_read_as_prose_and_arguments():
    """mkdocstrings reads the docstrings as Google style (mkdocs.yml), where a "Word: text" line between a blank
    line and an indented one opens a section or an admonition. Only a function's or class's untitled "Arguments:"
    or "Attributes:" is meant as one: anything else (`params: {...}` over several lines in a module docstring was
    a "Parameters" table) renders as something the author did not write."""
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extra (python3 dev.py docs)")
    packages = [griffe.load(name, search_paths=[str(ROOT)], docstring_parser="google") for name in PARTS]

    def walk(obj):
        yield obj
        for member in obj.members.values():
            if not member.is_alias:
                yield from walk(member)

    misread = [
        f"{obj.relative_filepath}:{obj.docstring.lineno + 0} ({obj.path}): a {section.kind.value} section "
        f"titled {section.title!r}"
        for package in packages
        for obj in walk(package)
        if obj.docstring
        for section in obj.docstring.parsed
        if section.kind.value != "text"
        and (obj.is_module or section.title is not None or section.kind.value not in ("parameters", "attributes"))
    ]
    assert not misread, (
        f"docstrings the API reference would render as sections their authors did not mean: {misread}; a line "
        f"'Word: text' after a blank line and before an indented line opens one: reword it (`params = {{...}}`)"
    )
