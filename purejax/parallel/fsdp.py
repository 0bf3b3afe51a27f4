"""Fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020): params, gradients and optimizer state
split over the data axis at rest, each param gathered just before it is used.

    at rest                 forward / backward                   gradient
    device i holds w[i]     all_gather(w[i]) -> w   (whole)       psum_scatter(dw) -> dw[i]
                            use w, then drop it                   (the transpose of all_gather)

`fsdp_specs` adds the data axis to a spec tree: each matrix is split on its first dimension that the data
axis divides and no other axis already splits, never the leading layer axis of stacked blocks (the scan
slices it). Vectors (biases, LayerNorm scales) stay replicated: a tiny share of the bytes, and gathering each
would cost a collective's latency. `gather` is what a model calls inside `shard_map`: one `all_gather` per
split leaf. Nothing is written for the gradients: under `jax.grad`, the transpose of `all_gather` is
`psum_scatter`, which sums the gradient over the data shards and leaves each device its own slice, exactly
ZeRO's reduce-scatter; the optimizer then updates that slice alone. `gathered` wraps one layer of a model so
that its params are gathered inside it, one layer's at a time (models/gpt_parallel.py).
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from purejax import tree as tree_lib

PyTree = Any


def fsdp_specs(shapes: PyTree, specs: PyTree, axis: str, size: int, *, stacked: Sequence[str] = ()) -> PyTree:
    """`specs` with `axis` (of `size` devices) added to every matrix, as the module docstring says.

    Arguments:
        shapes: the params' global shapes (arrays or ShapeDtypeStructs), with the structure of `specs`.
        stacked: dotted path prefixes (e.g. "blocks") whose leaves carry a leading layer axis, never split.
    """

    def add(path, shape, spec):
        name = tree_lib.path_to_str(path)
        first = 1 if any(name == s or name.startswith(s + ".") for s in stacked) else 0
        if shape.ndim - first < 2:
            return spec
        entries = list(spec) + [None] * (shape.ndim - len(spec))
        for dim in range(first, shape.ndim):
            if entries[dim] is None and shape.shape[dim] % size == 0:
                entries[dim] = axis
                return P(*entries)
        return spec  # no dimension divides evenly: this one stays whole

    return jax.tree_util.tree_map_with_path(add, shapes, specs, is_leaf=lambda x: isinstance(x, P))


def gather(tree: PyTree, specs: PyTree, axis: str) -> PyTree:
    """Inside `shard_map`: every leaf whose spec splits a dimension over `axis`, all-gathered whole along it
    (`tiled`: the shards are concatenated, not stacked). Other leaves come back as they are."""

    def one(x, spec):
        dims = [d for d, entry in enumerate(spec) if entry == axis]
        return jax.lax.all_gather(x, axis, axis=dims[0], tiled=True) if dims else x

    return jax.tree_util.tree_map(one, tree, specs)


def layer_specs(specs: PyTree) -> PyTree:
    """The specs of one layer of stacked blocks: each spec without its leading (layer) entry."""
    return jax.tree_util.tree_map(lambda s: P(*s[1:]), specs, is_leaf=lambda x: isinstance(x, P))


def gathered(layer: Callable[..., Any], specs: PyTree, axis: str) -> Callable[..., Any]:
    """`layer(params, *args)` on its params all-gathered over `axis` first, under `jax.checkpoint`: nothing of
    the layer is kept for the backward pass, which gathers the params again and recomputes the layer, so only
    one layer's whole params exist at a time (ZeRO-3 with activation checkpointing). A finer policy that saved
    every activation but the gathered params let XLA:CPU keep the gathered params of every layer alive
    instead (jax 0.10.2). `specs` are one layer's (`layer_specs` of stacked blocks)."""

    def on_gathered_params(params: PyTree, *args: Any) -> Any:
        return layer(gather(params, specs, axis), *args)

    return jax.checkpoint(on_gathered_params, policy=jax.checkpoint_policies.nothing_saveable)
