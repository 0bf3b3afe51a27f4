"""The layers of docs/design.md, held against every import in the tree: `train` may import `models` and
`purejax`, `models` may import `purejax`, and inside `purejax` a part imports only the parts below it. No
import circles in `purejax/` or `models/`.

Every `import` and `from ... import` counts, at the top of a file or inside a function, read from the source
(nothing is imported): an arrow that runs up a layer fails the test, naming the file, the line and the
import; a part missing from `LAYERS` fails too, until it is given its place (here and in docs/design.md).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first. A part is a top-level module or subpackage; `purejax` is the package's own __init__.
LAYERS = {
    "purejax": 0,  # __version__ and the lazy attributes
    "purejax._untrusted": 0,
    "purejax.tree": 0,
    "purejax.random": 0,
    "purejax.losses": 0,
    "purejax.sampling": 0,
    "purejax.nn": 1,
    "purejax.optim": 1,
    "purejax.precision": 1,
    "purejax.checkpoint": 1,
    "purejax._safetensors_header": 1,
    "purejax.parallel": 2,
    "purejax.lora": 2,
    "purejax.safetensors": 2,
    "models": 3,
    "train": 4,
}
OURS = ("purejax", "models", "train")


def part(module: str) -> str:
    """The part of `LAYERS` a module belongs to: `purejax.nn.linear` -> `purejax.nn`, `models.gpt` -> `models`."""
    names = module.split(".")
    return ".".join(names[:2]) if names[0] == "purejax" and len(names) > 1 else names[0]


def module_of(path: Path) -> str:
    names = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in `path`; `from a import b` names `a.b` (a module or a name in a)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; write the module's whole name"
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in OURS]


def sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def test_every_import_runs_down_the_layers():
    wrong = []
    for path in sources(*OURS):
        here = part(module_of(path))
        assert here in LAYERS, (
            f"{path.relative_to(ROOT)}: {here} has no layer; give it one in LAYERS and docs/design.md"
        )
        for line, name in imports(path):
            there = part(name)
            if there != here and LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({there}, not below {here})")
    assert not wrong, "imports against the layers of docs/design.md:\n" + "\n".join(wrong)


def test_no_import_circles_in_the_framework_or_the_models():
    modules = {module_of(p): p for p in sources("purejax", "models")}
    arrows = {m: set() for m in modules}
    for m, path in modules.items():
        for _, name in imports(path):
            # `from a import b`: the module a.b if there is one, else a (b is a name defined in a)
            target = name if name in modules else name.rpartition(".")[0]
            if target in modules and target != m and not m.startswith(target + "."):  # a package's own __init__
                arrows[m].add(target)
    circles = [circle for circle in _circles(arrows) if len(circle) > 1]
    assert not circles, "import circles: " + "; ".join(" -> ".join([*c, c[0]]) for c in circles)


def _circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of the import graph (Tarjan's algorithm), each a list of modules."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(arrows[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            found.append(component[::-1])

    for m in sorted(arrows):
        if m not in index:
            visit(m)
    return found


def test_the_checks_see_a_violation():
    """The part and import readers on a made-up arrow: models importing train is against the layers."""
    assert part("purejax.nn.linear") == "purejax.nn" and part("models.gpt") == "models" and part("purejax") == "purejax"
    assert LAYERS[part("train.gpt")] >= LAYERS[part("models.gpt")]
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"], ["c"]]
