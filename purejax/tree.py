"""Tools for plain pytrees of arrays: dotted paths, counts, casts, the global norm, a summary table and a
structural diff.

A leaf's *path* is its sequence of keys joined with dots: `params["blocks"]["attn"]["qkv"]["w"]` is
`"blocks.attn.qkv.w"`, a list element is its index (`"layers.0.w"`), a NamedTuple field its name
(`"adam.mu.w"`). Paths are how purejax names everything: checkpoints, weight import, summaries, errors.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey
from jaxtyping import Array, Float

PyTree = Any


def key_to_str(key: Any) -> str:
    """One entry of a jax key path as it appears in a dotted path."""
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_to_str(path: tuple[Any, ...]) -> str:
    """A jax key path, e.g. `(DictKey('blocks'), DictKey('w'))`, as a dotted path: `"blocks.w"`."""
    return ".".join(key_to_str(k) for k in path)


def flatten(tree: PyTree) -> dict[str, Any]:
    """The leaves of `tree` as `{dotted.path: leaf}`, in jax's leaf order. `None` is an empty node (no entry).

    Raises ValueError when two leaves would get the same path (a dict key containing a dot, `{"a.b": x}`
    beside `{"a": {"b": y}}`), since the flat form would silently lose one of them.
    """
    flat: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_to_str(path)
        if name in flat:
            raise ValueError(f"two leaves share the dotted path {name!r}; a key must not contain '.'")
        flat[name] = leaf
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `flatten` for trees of string-keyed dicts: `{"a.b": x}` becomes `{"a": {"b": x}}`.

    Other node kinds (lists, tuples, NamedTuples, integer dict keys) cannot be recovered from a path alone;
    use `unflatten_like` with a template for those.
    """
    tree: dict[str, Any] = {}
    for name, leaf in flat.items():
        *parents, last = name.split(".")
        node = tree
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {name!r} passes through the leaf {'.'.join(parents[: i + 1])!r}")
        if last in node:
            raise ValueError(f"path {name!r} names a node that already has children")
        node[last] = leaf
    return tree


def unflatten_like(like: PyTree, flat: Mapping[str, Any]) -> PyTree:
    """A tree with the structure of `like` whose leaves are `flat[path]`; every missing or extra path is
    reported at once (TreeMismatchError), shapes and dtypes are not compared."""
    paths = list(flatten(like))
    known = set(paths)
    report = TreeDiff(
        missing=[p for p in paths if p not in flat],
        unexpected=[p for p in flat if p not in known],
    )
    if not report.ok:
        raise TreeMismatchError(report.format("tree"))
    treedef = jax.tree_util.tree_structure(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])


def subtree(tree: PyTree, path: str) -> PyTree:
    """The node of `tree` at the dotted `path` (`""` is the whole tree): `subtree(state, "params.blocks.0")`.

    Each part matches a child the way `flatten` names it (a dict key, a list index, a NamedTuple field), so
    any prefix of a path from `flatten` works. Raises KeyError naming the missing part and what is there."""
    node = tree
    parts = path.split(".") if path else []
    for depth, part in enumerate(parts):
        level = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x, node=node: x is not node)[0]
        children = {key_to_str(keys[0]): child for keys, child in level if keys}
        if part not in children:
            where = ".".join(parts[:depth]) or "the root"
            there = ", ".join(repr(k) for k in children) or "nothing (a leaf or an empty node)"
            raise KeyError(f"no {part!r} under {where} (looking up {path!r}); it has {there}")
        node = children[part]
    return node


def count(tree: PyTree) -> int:
    """Total number of array elements (parameters) in `tree`."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(tree))


def nbytes(tree: PyTree) -> int:
    """Total bytes of the arrays in `tree` (typed PRNG keys count their key data, e.g. 8 bytes for threefry)."""
    return sum(int(np.prod(np.shape(x))) * _itemsize(x) for x in jax.tree_util.tree_leaves(tree))


def _itemsize(x: Any) -> int:
    # `dtype.itemsize` rather than `jnp.dtype(...)`: the latter rejects extended dtypes such as key<fry>.
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return dtype.itemsize


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """`tree` with every floating-point leaf cast to `dtype`; integer, bool and key leaves are left alone."""

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map(cast, tree)


def global_norm(tree: PyTree, axis_name: Any = None, *, specs: PyTree = None) -> Float[Array, ""]:
    """sqrt of the sum of squares of every element of every leaf, accumulated in float32 (at least).

    The same quantity as `optax.global_norm` and torch's `clip_grad_norm_` total norm (p=2).

    Inside `shard_map`, where each device holds only shards of some leaves, say which:
        axis_name: a mesh axis name (or a tuple of them) that *every* leaf is split over.
        specs: a tree with the structure of `tree` whose leaves are `PartitionSpec`s: each leaf's local sum
            of squares is `psum`-med over the mesh axes its spec names, and only those. A replicated leaf
            (`P()`) is not reduced at all: every device already holds all of it, and a psum would count it
            once per device.
    Every device then gets the norm of the whole tree. Leave both None on one device."""
    if axis_name is not None and specs is not None:
        raise ValueError(
            "global_norm: give axis_name (every leaf split over the same axes) or specs (per leaf), not both"
        )
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)

    def sum_of_squares(x):
        return jnp.sum(jnp.square(jnp.abs(x).astype(jnp.promote_types(x.real.dtype, jnp.float32))))

    if specs is None:
        total = sum(sum_of_squares(x) for x in leaves)
        return jnp.sqrt(total if axis_name is None else jax.lax.psum(total, axis_name))
    spec_leaves = jax.tree_util.tree_structure(tree).flatten_up_to(specs)
    by_axes: dict[tuple[str, ...], Any] = {}  # one psum per distinct set of axes, not one per leaf
    for x, spec in zip(leaves, spec_leaves):
        axes = tuple(
            sorted({a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)})
        )
        by_axes[axes] = by_axes.get(axes, 0.0) + sum_of_squares(x)
    return jnp.sqrt(sum(jax.lax.psum(part, axes) if axes else part for axes, part in by_axes.items()))


def describe(x: Any) -> str:
    """`float32[65,384]`: the dtype and shape of an array-like leaf, the way errors and tables print it."""
    dtype = getattr(x, "dtype", None)
    name = jnp.dtype(dtype).name if dtype is not None and not _is_key_dtype(dtype) else str(dtype or type(x).__name__)
    return f"{name}[{','.join(str(d) for d in np.shape(x))}]"


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


class TreeMismatchError(ValueError):
    """Two trees that should have the same paths, shapes and dtypes do not; the message lists every difference."""


@dataclass
class TreeDiff:
    """Every way in which one tree differs from another, by dotted path."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (path, expected, got)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)  # (path, expected, got)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape or self.dtype)

    def format(self, name: str = "tree") -> str:
        """A readable report, one line per difference, grouped by kind."""
        if self.ok:
            return f"{name} matches"
        lines = [f"{name} does not match the expected structure:"]
        lines += [f"  missing:        {p}" for p in self.missing]
        lines += [f"  unexpected:     {p}" for p in self.unexpected]
        lines += [f"  shape mismatch: {p}: expected {e}, got {g}" for p, e, g in self.shape]
        lines += [f"  dtype mismatch: {p}: expected {e}, got {g}" for p, e, g in self.dtype]
        return "\n".join(lines)

    __str__ = format


def diff(got: PyTree, expected: PyTree, *, check_dtype: bool = True) -> TreeDiff:
    """Compare two trees path by path: missing and unexpected paths, and shape and dtype mismatches.

    Leaves may be arrays or `jax.ShapeDtypeStruct`s, so `expected` can be `jax.eval_shape(init, ...)`."""
    got_flat, want_flat = flatten(got), flatten(expected)
    report = TreeDiff(
        missing=[p for p in want_flat if p not in got_flat],
        unexpected=[p for p in got_flat if p not in want_flat],
    )
    for path, want in want_flat.items():
        if path not in got_flat:
            continue
        have = got_flat[path]
        if np.shape(have) != np.shape(want):
            report.shape.append((path, tuple(np.shape(want)), tuple(np.shape(have))))
        if check_dtype and _dtype_name(have) != _dtype_name(want):
            report.dtype.append((path, _dtype_name(want), _dtype_name(have)))
    return report


def _dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return str(dtype) if _is_key_dtype(dtype) else jnp.dtype(dtype).name


def assert_like(got: PyTree, expected: PyTree, name: str = "tree", *, check_dtype: bool = True) -> None:
    """Raise TreeMismatchError listing every difference between `got` and `expected` (see `diff`)."""
    report = diff(got, expected, check_dtype=check_dtype)
    if not report.ok:
        raise TreeMismatchError(report.format(name))


def summary(tree: PyTree, fn: Callable | None = None, *args: Any, **kwargs: Any) -> str:
    """A text table of `tree`: path, shape, dtype, element count and bytes of every leaf, then the totals.

    With `fn` (and its arguments), also the FLOPs of `jax.jit(fn)(*args, **kwargs)` from XLA's cost analysis.
    """
    rows = [(p, str(tuple(np.shape(x))), _dtype_name(x), count(x), nbytes(x)) for p, x in flatten(tree).items()]
    header = ("path", "shape", "dtype", "count", "bytes")
    total = ("total", "", "", count(tree), nbytes(tree))
    cells = [header] + [(p, s, d, f"{c:,}", _human_bytes(b)) for p, s, d, c, b in [*rows, total]]
    widths = [max(len(row[i]) for row in cells) for i in range(5)]

    def line(row):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(cells[0]), rule, *map(line, cells[1:-1]), rule, line(cells[-1])]
    if fn is not None:
        out.append(f"flops: {flops(fn, *args, **kwargs):,.0f} (XLA cost analysis)")
    return "\n".join(out)


def flops(fn: Callable, *args: Any, **kwargs: Any) -> float:
    """Floating-point operations of one call of `jax.jit(fn)`, as XLA's cost analysis counts them."""
    cost = jax.jit(fn).lower(*args, **kwargs).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per device
        cost = cost[0]
    return float(cost.get("flops", 0.0)) if cost else 0.0


def _human_bytes(n: int) -> str:
    """`n` bytes in decimal units: "512 B", "1.5 KB", ..., "2048.0 GB"."""
    if n < 1000:
        return f"{n} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}"
