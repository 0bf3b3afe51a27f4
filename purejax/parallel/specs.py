r"""Sharding specs from parameter paths: a declarative table, and the helpers that place trees on a mesh.

A `PartitionSpec` says, per array dimension, which mesh axis it is split over (None: whole on every device):
`P(None, "model")` splits the columns of a matrix over "model" and copies it over every other axis. A model
states its layout once, as a table of (path pattern, spec) rows, read top down, first match wins:

    RULES = (
        (r"wte\.w", P(MODEL, None)),                  # vocabulary rows over the model axis
        (r"blocks\.attn\.qkv\.w", P(None, None, MODEL)),  # (layer, d_model, qkv columns): columns split
        (r".*", P()),                                  # everything else replicated
    )
    specs = specs_from_rules(params_or_shapes, RULES, {MODEL: "model"})   # a tree of PartitionSpec

The names in a table are roles (`MODEL`, `DATA`); the third argument maps each role to the mesh axis it runs
under, or to None when that kind of parallelism is off (the dimension is then whole). `state_specs` extends a
param spec tree to a whole training state, `shard` places a tree on a mesh, `local_shape` is what one device
holds.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from purejax import tree as tree_lib

PyTree = Any
Rules = Sequence[tuple[str, P]]


def specs_from_rules(shapes: PyTree, rules: Rules, roles: Mapping[str, str | None]) -> PyTree:
    """A PartitionSpec for every leaf of `shapes` (arrays or ShapeDtypeStructs): the spec of the first rule
    whose pattern matches the leaf's whole dotted path, with role names replaced through `roles`. A leaf no
    rule matches is an error (a new parameter must get a decision, not a silent default)."""
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec_of(path, leaf):
        name = tree_lib.path_to_str(path)
        for pattern, spec in compiled:
            if pattern.fullmatch(name):
                if len(spec) > leaf.ndim:
                    raise ValueError(
                        f"sharding rule {pattern.pattern!r} -> {spec} has more entries than {name} has dims "
                        f"({leaf.shape})"
                    )
                return P(*(roles.get(entry, entry) if entry is not None else None for entry in spec))
        raise ValueError(
            f"no sharding rule matches the param {name!r} {tuple(leaf.shape)}; add a row for it (or a catch-all r'.*')"
        )

    return jax.tree_util.tree_map_with_path(spec_of, shapes)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis `spec` splits over, in order: `P("data", ("model", "pipe"))` -> ("data", "model", "pipe")."""
    entries = [(entry,) if isinstance(entry, str) else entry for entry in spec if entry is not None]
    return tuple(axis for entry in entries for axis in entry)


def local_shape(shape: Sequence[int], spec: P, sizes: Mapping[str, int], name: str = "array") -> tuple[int, ...]:
    """The shape one device holds of an array of global `shape` split as `spec` over axes of these `sizes`.
    Raises, naming the array, the dimension and the axis, when a split is uneven."""
    out = list(shape)
    if len(spec) > len(shape):
        raise ValueError(f"{name} {tuple(shape)}: its spec {spec} has more entries than the array has dimensions")
    for dim, entry in enumerate(spec):
        for axis in spec_axes(P(entry)):
            if axis not in sizes:
                raise ValueError(
                    f"{name} {tuple(shape)}: its spec {spec} names mesh axis {axis!r}, but the mesh "
                    f"has axes {dict(sizes)}"
                )
            size = sizes[axis]
            if out[dim] % size:
                raise ValueError(
                    f"{name} {tuple(shape)}: dimension {dim} ({shape[dim]}) cannot be split evenly over the "
                    f"{size} devices of mesh axis {axis!r}; pad it to a multiple of {size} or pick another mesh"
                )
            out[dim] //= size
    return tuple(out)


def check_divisible(shapes: PyTree, specs: PyTree, sizes: Mapping[str, int]) -> None:
    """Raise if any leaf of `shapes` cannot be split as its spec says over a mesh with these axis `sizes`."""

    def check(path, spec, leaf):  # walking both trees at once raises if their structures differ
        local_shape(leaf.shape, spec, sizes, tree_lib.path_to_str(path))

    jax.tree_util.tree_map_with_path(check, specs, shapes, is_leaf=_is_spec)


def check_shards(params: PyTree, shapes: PyTree, specs: PyTree, what: str = "params") -> None:
    """Inside `shard_map`: raise, naming every leaf, unless each of `params` is this device's shard of the
    whole arrays `shapes` (a tree of ShapeDtypeStruct) as `specs` split them. A model's `_forward` calls it
    first, so that params placed with other specs fail here with their paths, not deep inside a matmul."""
    sizes = {name: jax.lax.axis_size(name) for spec in jax.tree.leaves(specs) for name in spec_axes(spec)}
    local = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(local_shape(s.shape, spec, sizes), s.dtype), shapes, specs
    )
    report = tree_lib.diff(params, local, check_dtype=False)
    if not report.ok:
        raise tree_lib.TreeMismatchError(
            report.format(f"{what} (this device's shards, as param_specs(config, axes, mesh.shape) says)")
            + "\nwere they placed with parallel.shard(params, param_specs(...), mesh) and passed through "
            "shard_map with those specs?"
        )


def shard(tree: PyTree, specs: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """`tree` placed on `mesh`, each leaf split as its spec says (`specs` has the tree's structure, or is a
    prefix of it). Every device receives only its own slice, in a buffer of its own, so donating the result
    to a step never deletes the caller's arrays.

    On a mesh spanning several processes, every process passes the same whole values (params initialised
    from the same key, say) and builds the shards of its own devices from them; nothing crosses processes."""
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    is_sharding = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    if any(device.process_index != jax.process_index() for device in mesh.devices.flat):
        return jax.tree_util.tree_map(
            lambda s, sub: jax.tree_util.tree_map(lambda x: _from_host(x, s), sub), shardings, tree, is_leaf=is_sharding
        )

    def own_copy(x, sharding):
        # device_put hands a device that is to hold the whole array the caller's own buffer when it already
        # has it there (jax 0.10.2, even with may_alias=False); a donated step would then delete it.
        whole = local_shape(x.shape, sharding.spec, mesh.shape) == tuple(x.shape)
        return jnp.copy(x) if whole and isinstance(x, jax.Array) else x

    tree = jax.tree_util.tree_map(
        lambda s, sub: jax.tree_util.tree_map(lambda x: own_copy(x, s), sub), shardings, tree, is_leaf=is_sharding
    )
    return jax.device_put(tree, shardings)


def _from_host(x: Any, sharding: NamedSharding) -> jax.Array:
    """The global array of value `x` (whole, on this process) laid out by `sharding`, building only this
    process's shards; typed PRNG keys through their key data."""
    if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        data = _from_host(jax.random.key_data(x), sharding)  # key data's extra trailing axis stays whole
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def state_specs(state: PyTree, param_specs: PyTree) -> PyTree:
    """Specs for a whole training state (`purejax.optim.TrainState`, or any tree holding the params and
    params-shaped optimizer statistics): a leaf whose dotted path ends with a param's path (`params.wte.w`,
    `opt_state.adam.mu.wte.w`, `ema.average.wte.w`) is split like that param; everything else (step counts,
    the loss scale, the key) is replicated.

    Optimizers with elementwise state (SGD, Adam(W), Lion, RMSProp) then update each shard on its own. Any
    other leaf derived from a sharded param (Adafactor's factored row and column statistics, `...w.row`) is
    an error: those statistics reduce over a whole row, which a shard does not hold."""
    by_path = dict(zip(_paths(param_specs), jax.tree_util.tree_leaves(param_specs, is_leaf=_is_spec)))

    def spec_of(path, leaf):
        name = tree_lib.path_to_str(path)
        within = [p for p in by_path if f".{p}." in f".{name}."]  # the param's path inside the leaf's
        if not within:
            return P()
        param = max(within, key=len)  # the longest: "mlp.proj.w" over a top-level "w"
        spec = by_path[param]
        if all(entry is None for entry in spec):
            return P()
        if not (name == param or name.endswith("." + param)) or len(leaf.shape) < len(spec):
            raise ValueError(
                f"state_specs: {name} {tuple(leaf.shape)} belongs to the sharded param {param!r} ({spec}) but is "
                f"not shaped like it; optimizer state of another shape (e.g. Adafactor's factored row and column "
                f"statistics) cannot be split with its param: use an optimizer with elementwise state "
                f"(Adam(W), SGD, Lion)"
            )
        return spec

    return jax.tree_util.tree_map_with_path(spec_of, state)


def _paths(specs: PyTree) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    return [tree_lib.path_to_str(path) for path, _ in flat]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)
