"""Data parallelism: where the gradient all-reduce comes from.

Replicated params (the same on every device of the data axis) meet a batch that is split over it. Under
`shard_map(..., check_vma=True)` a value is typed "invariant" or "varying" over each axis, and an invariant
param used with a varying activation must first be cast to varying: a no-op in the forward pass, whose
transpose under `jax.grad` is a `psum` over the axis, i.e. the sum of every shard's gradient.

JAX inserts that cast by itself at every place a param is used; a param used twice (GPT's tied embedding:
the lookup and the output head) then gets two all-reduces, and a param used inside a scan gets one per layer
iteration. `vary` makes the cast once, up front, for the whole tree: one all-reduce per param, of exactly the
params' bytes (tests/purejax/parallel counts them in the compiled program).

    params = vary(params, specs, "data")   # forward: nothing; backward: psum of every gradient over "data"
"""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from purejax.parallel.specs import spec_axes

PyTree = Any


def vary(tree: PyTree, specs: PyTree, axis: str) -> PyTree:
    """Inside `shard_map`: every leaf whose spec does not split it over `axis` (replicated over it) cast to
    varying over `axis` (`jax.lax.pcast(..., to="varying")`). Leaves already split over `axis` (FSDP shards)
    are varying already; they come back as they are."""

    def one(x, spec):
        return x if axis in spec_axes(spec) else jax.lax.pcast(x, axis, to="varying")

    return jax.tree_util.tree_map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))
