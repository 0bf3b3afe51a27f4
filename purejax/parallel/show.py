"""Who holds what: which device holds which slice of each array of a tree, as text.

    print(parallel.describe(params))                          # arrays already placed (parallel.shard)
    print(parallel.describe(shapes, specs=specs, mesh=mesh))  # before placing: shapes (eval_shape) and specs

One line per leaf: its dotted path, global shape, spec, and each device's slice, `d<id>[rows, cols, ...]`
(Python slice notation over the global array), then the share of the array one device holds. It is read off
the real sharding (`Sharding.devices_indices_map`, the map jax itself places data by), not derived from the
spec by hand, so it is the layout the program runs with. docs/tutorial/09-data-tensor-fsdp.md uses it to
draw data, tensor and fully sharded parallelism side by side.
"""

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from purejax.tree import PyTree, path_to_str


def describe(tree: PyTree, *, specs: PyTree = None, mesh: jax.sharding.Mesh | None = None) -> str:
    """Each leaf of `tree` as `path shape spec d0[slices] d1[slices] ... (share per device)`, one per line.

    Arguments:
        tree: arrays, or anything with a `.shape` (`jax.ShapeDtypeStruct` from `jax.eval_shape`).
        specs: a `PartitionSpec` per leaf, the tree's structure; None: each leaf's own `NamedSharding`.
        mesh: the mesh the specs name axes of; needed with `specs`, ignored without.
    """
    if specs is None:
        shardings = jax.tree_util.tree_map(_sharding_of, tree)
    elif mesh is None:
        raise ValueError("describe: specs were given without the mesh they name axes of; pass mesh=...")
    elif (want := jax.tree_util.tree_structure(tree)) != (got := jax.tree_util.tree_structure(specs, is_leaf=_is_spec)):
        raise ValueError(f"describe: specs {got} do not match the tree {want}; give one PartitionSpec per leaf")
    else:
        shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat_shardings = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = [(path_to_str(path), tuple(leaf.shape), sharding) for (path, leaf), sharding in zip(pairs, flat_shardings)]
    width = max((len(f"{name} {shape} {sharding.spec}") for name, shape, sharding in rows), default=0)
    return "\n".join(_line(name, shape, sharding, width) for name, shape, sharding in rows)


def _line(name: str, shape: tuple[int, ...], sharding: NamedSharding, width: int) -> str:
    placed = sharding.devices_indices_map(shape)
    pieces = [f"d{device.id}[{_slices(placed[device], shape)}]" for device in sorted(placed, key=lambda d: d.id)]
    whole = math.prod(shape)
    one = math.prod(len(range(*index.indices(n))) for index, n in zip(placed[next(iter(placed))], shape))
    share = f"{100 * one / whole:g}%" if whole else "empty"
    return f"{f'{name} {shape} {sharding.spec}':<{width}}  " + "  ".join(pieces) + f"  ({share} each)"


def _slices(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    return ", ".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _sharding_of(leaf: Any) -> NamedSharding:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"describe: a leaf of shape {getattr(leaf, 'shape', '?')} has sharding {sharding!r}, not a "
            "NamedSharding; place the tree with parallel.shard(tree, specs, mesh), or pass specs=... and mesh=..."
        )
    return sharding


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)
