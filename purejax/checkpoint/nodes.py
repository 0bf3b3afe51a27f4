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

Limits, the same on save and on restore: containers nest at most `format.MAX_DEPTH` (100) deep, and a
NamedTuple has at most `MAX_FIELDS` fields (making a namedtuple class costs time in its number of fields).
"""

import collections
import functools
from typing import Any

import jax
import numpy as np

from purejax.checkpoint.format import MAX_DEPTH

PyTree = Any
MAX_FIELDS = 1000
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
                "kind": "namedtuple", "name": type(x).__name__, "module": type(x).__module__, "fields": fields,
                "children": [walk(getattr(x, f), (*path, f)) for f in fields],
            }  # fmt: skip
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
    """The tree `node` describes, with each leaf replaced by its manifest index (an int).

    Raises ValueError, saying where, for a malformed node, containers nested more than `MAX_DEPTH` deep, or
    when the leaves are not numbered 0, 1, ... `n_leaves - 1` in depth-first order (so every manifest entry
    is used exactly once)."""
    count = 0

    def walk(x: Any, where: str, depth: int = 0) -> Any:
        nonlocal count
        if not isinstance(x, dict) or "kind" not in x:
            raise ValueError(f"node at {where or 'the root'} is not a map with a 'kind'")
        kind = x["kind"]
        if depth >= MAX_DEPTH and kind not in ("leaf", "none"):
            raise ValueError(f"containers are nested more than {MAX_DEPTH} deep, at {_cut(where)}")
        if kind == "leaf":
            if type(x.get("index")) is not int or x["index"] != count:
                raise ValueError(f"leaf at {where} has index {x.get('index')!r}, expected {count}")
            count += 1
            return x["index"]
        if kind == "none":
            return None
        children = x.get("children")
        if not isinstance(children, list):
            raise ValueError(f"{kind} node at {where} has no 'children' list")
        if kind == "dict":
            keys = x.get("keys")
            if not isinstance(keys, list) or not all(type(k) in (str, int) for k in keys):
                raise ValueError(f"dict node at {where} has keys that are neither str nor int")
            if len({type(k) for k in keys}) > 1:
                raise ValueError(f"dict node at {where} mixes str and int keys, which cannot be sorted")
            if len(keys) != len(children) or len(set(keys)) != len(keys):
                raise ValueError(f"dict node at {where} needs as many distinct 'keys' as children")
            return {k: walk(c, _join(where, k), depth + 1) for k, c in zip(keys, children)}
        if kind in ("list", "tuple"):
            items = [walk(c, _join(where, i), depth + 1) for i, c in enumerate(children)]
            return items if kind == "list" else tuple(items)
        if kind == "namedtuple":
            fields = x.get("fields")
            if not isinstance(fields, list) or len(fields) != len(children):
                raise ValueError(f"namedtuple node at {where} needs one field name per child")
            if len(fields) > MAX_FIELDS:
                raise ValueError(f"namedtuple node at {where} has {len(fields):,} fields, more than {MAX_FIELDS}")
            cls = namedtuple_type(x.get("name"), tuple(fields), x.get("module"), where)
            return cls(*(walk(c, _join(where, f), depth + 1) for f, c in zip(fields, children)))
        raise ValueError(f"node at {where or 'the root'} has the unknown kind {kind!r}")

    tree = walk(node, "")
    if count != n_leaves:
        raise ValueError(f"the tree has {count} leaves but the manifest lists {n_leaves}")
    return tree


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


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
