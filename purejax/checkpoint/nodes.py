"""The node kinds of a tree, recorded so that restore rebuilds lists, tuples, NamedTuples, None and
integer-keyed dicts as they were, not only nested string-keyed dicts.

A node is a msgpack map with a "kind":

    {"kind": "leaf", "index": i}                             the i-th manifest entry (depth-first order)
    {"kind": "none"}                                         None, an empty node to jax
    {"kind": "dict", "keys": [k, ...], "children": [...]}    keys all str or all int, in jax's sorted order
    {"kind": "list", "children": [...]}
    {"kind": "tuple", "children": [...]}
    {"kind": "namedtuple", "name": "ScaleByAdamState", "module": "optax._src.transform",
     "fields": ["count", "mu", "nu"], "children": [...]}

Leaves are numbered in the order `jax.tree_util` flattens the tree, so the manifest order is the order of
`purejax.tree.flatten`. A NamedTuple is restored without a template as a namedtuple of the same name and
fields made by `collections.namedtuple` (the original class is never imported: reading a file runs no code);
with a template, the template's own class is used.

A reader rebuilds the tree straight from the header's bytes, a node at a time (`read`), never building the
node maps themselves, and checks each leaf against its manifest entry's path as it meets it.

Limits, the same on save and on restore: containers nest at most `format.MAX_DEPTH` (100) deep, and a
NamedTuple has at most `MAX_FIELDS` fields (making a namedtuple class costs time in its number of fields);
what reading builds is charged to the header's memory budget (stream.py).
"""

import collections
import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import msgpack
import numpy as np

from purejax.checkpoint.format import MAX_DEPTH
from purejax.checkpoint.stream import Budget, Stream

PyTree = Any
MAX_FIELDS = 1000
_CLASS_BYTES, _FIELD_BYTES = 6 * 2**10, 256  # what making a namedtuple class allocates (CPython 3.11, measured)
LEAF_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def encode(tree: PyTree) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """`(node, leaves)`: the node-kind description of `tree` and its leaves as `(dotted path, leaf)` pairs.

    Raises TypeError naming the path of anything that is not one of the node kinds above or an array leaf
    (a jax or numpy array, a numpy scalar, or a Python bool, int, float or complex), and ValueError for
    containers nested more than `MAX_DEPTH` deep."""
    leaves: list[tuple[str, Any]] = []

    def walk(x: Any, path: tuple[str, ...]) -> dict[str, Any]:
        where = ".".join(path) or "the root"
        if x is None:
            return {"kind": "none"}
        if len(path) >= MAX_DEPTH and not isinstance(x, LEAF_TYPES):
            raise ValueError(f"{_cut(where)} is nested more than {MAX_DEPTH} deep, deeper than a checkpoint holds")
        if type(x) is dict:
            keys = _sorted_keys(x, where)
            return {"kind": "dict", "keys": keys, "children": [walk(x[k], (*path, str(k))) for k in keys]}
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):
            fields = list(type(x)._fields)
            if len(fields) > MAX_FIELDS:
                raise ValueError(f"{where} is a NamedTuple of {len(fields)} fields, more than the {MAX_FIELDS} allowed")
            return {
                "kind": "namedtuple",
                "name": type(x).__name__,
                "module": type(x).__module__,
                "fields": fields,
                "children": [walk(getattr(x, f), (*path, f)) for f in fields],
            }
        if type(x) in (list, tuple):
            children = [walk(c, (*path, str(i))) for i, c in enumerate(x)]
            return {"kind": type(x).__name__, "children": children}
        if isinstance(x, LEAF_TYPES):
            leaves.append((".".join(path), x))
            return {"kind": "leaf", "index": len(leaves) - 1}
        raise TypeError(
            f"{where} is a {type(x).__module__}.{type(x).__qualname__}, which a checkpoint cannot hold: trees are "
            "dicts, lists, tuples, NamedTuples and None over jax/numpy arrays and scalars (convert it, e.g. "
            "with dict(...) or dataclasses.asdict; strings and settings belong in `config` or `metadata`)"
        )

    return walk(tree, ()), leaves


def _sorted_keys(d: dict, where: str) -> list:
    kinds = {type(k) for k in d}
    if not kinds <= {str, int} or len(kinds) > 1:
        names = ", ".join(sorted(t.__name__ for t in kinds))
        raise TypeError(f"the dict at {where} has keys of type {names}; a checkpoint takes all-str or all-int keys")
    return sorted(d)  # the order jax flattens a dict in


def decode(node: Any, n_leaves: int) -> PyTree:
    """The tree `node` (a node map, as `encode` makes it) describes, with each leaf replaced by its manifest
    index (an int): `read` over the node's msgpack bytes. Raises ValueError, saying where, as `read` does."""
    raw = msgpack.packb(node, use_bin_type=True)
    return read(Stream(raw, Budget(len(raw))), n_leaves)


def read(stream: Stream, n_leaves: int, paths: Sequence[str] | None = None) -> PyTree:
    """The tree whose root node comes next in `stream`, with each leaf replaced by its manifest index (an int),
    read a node at a time: the node maps themselves are never built, and each container of the result (and
    each NamedTuple class made) is charged to the stream's budget.

    Raises ValueError, saying where, for a malformed node, containers nested more than `MAX_DEPTH` deep, or
    when the leaves are not numbered 0, 1, ... `n_leaves - 1` in depth-first order (so every manifest entry
    is used exactly once); with `paths` (each manifest entry's dotted path), also when a leaf is not at its
    entry's path. A leaf's path is compared by length before it is built, so a crafted tree of long keys over
    many leaves costs no more than its own bytes."""
    reader = _Reader(stream, n_leaves, paths)
    tree = reader.node(0)
    if reader.count != n_leaves:
        raise ValueError(f"the tree has {reader.count} leaves but the manifest lists {n_leaves}")
    return tree


_NODE_FIELDS = ("kind", "index", "keys", "name", "module", "fields")  # a node's keys besides "children"


class _Reader:
    """`read`'s state: the stream, the leaves counted so far, and the keys from the root to the current node
    (with the length of the dotted path they make, so that a path is built only to be compared)."""

    def __init__(self, stream: Stream, n_leaves: int, paths: Sequence[str] | None):
        self.stream, self.n_leaves, self.paths = stream, n_leaves, paths
        self.count, self.keys, self.length = 0, [], 0
        self.classes: set = set()  # the NamedTuple classes this tree uses, each charged once

    def where(self) -> str:
        return _cut(".".join(self.keys)) or "the root"

    def node(self, depth: int) -> Any:
        n = self.stream.map_header()
        if n is None:
            raise ValueError(f"node at {self.where()} is not a map with a 'kind'")
        fields, children_at = {}, None
        for _ in range(n):  # keys in any order; those this reader does not know are passed over
            key = self.stream.value()
            if key == "children" and _names_known(fields):
                fields["children"] = self.children(self.stream, fields, depth)
            elif key == "children" and fields.get("kind") not in ("leaf", "none"):
                # before the kind, keys or fields that name the children: read them once the map is done
                children_at = self.stream.offset
                self.stream.skip()
            elif type(key) is str and key in _NODE_FIELDS:
                fields[key] = self.stream.value()
            else:
                self.stream.skip()
        if children_at is not None and fields.get("kind") not in ("leaf", "none"):
            fields["children"] = self.children(self.stream.at(children_at), fields, depth)
        return self.build(fields, depth)

    def children(self, stream: Stream, fields: dict, depth: int) -> list:
        """The children of a node whose other fields are `fields`, each read with its key on the path."""
        kind = fields.get("kind")
        n = stream.array_header()
        if n is None:
            raise ValueError(f"{kind} node at {self.where()} has no 'children' list")
        if depth >= MAX_DEPTH:
            raise ValueError(f"containers are nested more than {MAX_DEPTH} deep, at {self.where()}")
        names = fields.get("keys") if kind == "dict" else fields.get("fields") if kind == "namedtuple" else None
        names = names if isinstance(names, list) and len(names) == n else range(n)
        outer, children = self.stream, []
        self.stream = stream
        for name in names:
            name = str(name)
            self.keys.append(name)
            self.length += len(name) + (len(self.keys) > 1)
            children.append(self.node(depth + 1))
            self.length -= len(name) + (len(self.keys) > 1)
            self.keys.pop()
        self.stream = outer
        return children

    def build(self, fields: dict, depth: int) -> Any:
        kind, children, budget = fields.get("kind"), fields.get("children"), self.stream.budget
        if kind == "leaf":
            return self.leaf(fields.get("index"))
        if kind == "none":
            return None
        if kind not in ("dict", "list", "tuple", "namedtuple"):
            raise ValueError(f"node at {self.where()} has the unknown kind {kind!r}")
        if not isinstance(children, list):
            raise ValueError(f"{kind} node at {self.where()} has no 'children' list")
        if kind == "dict":
            result = self.make_dict(fields.get("keys"), children)
        elif kind == "namedtuple":
            result = self.make_namedtuple(fields, children)
        else:
            result = children if kind == "list" else tuple(children)
        budget.charge(sys.getsizeof(result))
        return result

    def leaf(self, index: Any) -> int:
        if type(index) is not int or index != self.count:
            raise ValueError(f"leaf at {self.where()} has index {index!r}, expected {self.count}")
        if index >= self.n_leaves:
            raise ValueError(f"the tree has more leaves than the {self.n_leaves} the manifest lists")
        if self.paths is not None:
            expected = self.paths[index]
            if len(expected) != self.length or expected != ".".join(self.keys):
                problem = f"manifest entry {index} is {_cut(expected)!r}, the tree puts {self.where()!r} there"
                raise ValueError(problem)
        self.count += 1
        self.stream.budget.charge(sys.getsizeof(index) if index > 256 else 0)
        return index

    def make_dict(self, keys: Any, children: list) -> dict:
        where = self.where()
        if not isinstance(keys, list) or not all(type(k) in (str, int) for k in keys):
            raise ValueError(f"dict node at {where} has keys that are neither str nor int")
        if len({type(k) for k in keys}) > 1:
            raise ValueError(f"dict node at {where} mixes str and int keys, which cannot be sorted")
        result = dict(zip(keys, children))
        if len(keys) != len(children) or len(result) != len(keys):
            raise ValueError(f"dict node at {where} needs as many distinct 'keys' as children")
        return result

    def make_namedtuple(self, fields: dict, children: list) -> tuple:
        names = fields.get("fields")
        if not isinstance(names, list) or len(names) != len(children):
            raise ValueError(f"namedtuple node at {self.where()} needs one field name per child")
        if len(names) > MAX_FIELDS:
            raise ValueError(f"namedtuple node at {self.where()} has {len(names):,} fields, more than {MAX_FIELDS}")
        cls = namedtuple_type(fields.get("name"), tuple(names), fields.get("module"), self.where())
        if cls not in self.classes:  # making a class costs ~5 KiB and ~250 bytes per field
            self.stream.budget.charge(_CLASS_BYTES + _FIELD_BYTES * len(names))
            self.classes.add(cls)
        return cls(*children)


def _names_known(fields: dict) -> bool:
    """Whether a node's fields read so far say what its children are called: a list's or tuple's by index, a
    dict's by its keys, a NamedTuple's by its fields."""
    kind = fields.get("kind")
    return (
        kind in ("list", "tuple")
        or (kind == "dict" and "keys" in fields)
        or (kind == "namedtuple" and "fields" in fields)
    )


def _cut(where: str) -> str:
    return where if len(where) <= 80 else f"{where[:77]}..."


def namedtuple_type(name: Any, fields: tuple, module: Any = None, where: str = "") -> type:
    """The generic namedtuple class standing in for a recorded NamedTuple: one class per (name, fields,
    module), so trees restored from different files have equal jax tree structures. `module` only labels
    the class (its `__module__`, so saving it again records the same); nothing is imported."""
    try:
        return _namedtuple_type(name, fields, module)
    except (TypeError, ValueError) as e:
        raise ValueError(f"namedtuple node at {where or 'the root'} has an invalid name or fields: {e}") from e


@functools.lru_cache(maxsize=1024)  # bounded: a stream of files cannot grow it without end
def _namedtuple_type(name: str, fields: tuple, module: str | None) -> type:
    if not isinstance(name, str) or not all(isinstance(f, str) for f in fields):
        raise TypeError(f"name {name!r} and fields {fields!r} must be strings")
    return collections.namedtuple(name, fields, module=module if isinstance(module, str) else None)
