"""Stacks of identical blocks, run either way: `lax.scan` over params stacked on a leading layer axis, or a
Python loop over a list of per-layer params. Both compute the same function and agree to float32 rounding, but
not always bit for bit: XLA may fuse an unrolled loop differently from a scan body (the GPT's two forms differ in
the last bits). The helpers convert between the two layouts losslessly.

    blocks = stack.init(key, n_layer, lambda k: block_init(k, config))  # every leaf gets a leading n_layer axis
    x = stack.scan(lambda p, x: block_apply(p, x, config), blocks, x)    # one traced block, any depth
    x = stack.loop(lambda p, x: block_apply(p, x, config), stack.unstack(blocks), x)  # n_layer traced blocks

Why both. `scan` traces and compiles the block once, so compile time does not grow with depth; `loop`
unrolls, which lets XLA fuse across layers and lets a reader step through layers one by one. `apply(mode, ...)`
runs either by name, and mode "auto" (`resolve`) picks `loop` up to `AUTO_LOOP_DEPTH` layers, `scan` beyond
and for rematerialised blocks: shallow stacks are a few percent faster unrolled on a CPU while their compile
time is still about scan's, deep ones compile in time flat in depth (docs/benchmarks.md, GPT training step:
"Scan, loop or auto").

A model runs its blocks with `run(layer, blocks, x, mode=config.layers, remat=config.remat, key=key)`: the mode
resolved, the layer under remat (purejax/nn/remat.py) and per-layer keys, written once for the GPT and the Llama.

Keys. Layer i's key is `jax.random.fold_in(key, i)` (`layer_keys`): it depends on the index alone, so
appending a layer changes no other layer's initialisation. `init` builds all layers in one vmapped trace of
`init_fn`, not one trace per layer. Pass `layer_keys(key, n)` as `xs` to give each layer its own dropout key.

Per-layer inputs and outputs. With `xs` (a pytree whose leaves have a leading layer axis: dropout keys,
key/value caches), the block is called as `block_apply(layer_params, x, layer_xs) -> (x, layer_ys)` and the
stack returns `(x, ys)`, `ys` stacked along the layer axis: the scan body gets a layer's cache and returns
its new cache. Without `xs`, it is `block_apply(layer_params, x) -> x` and the stack returns `x`.
"""

import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Key, PRNGKeyArray, UInt32

from purejax import tree as tree_lib
from purejax.nn import remat as remat_lib
from purejax.nn._check import check_same_leading_axis

PyTree = Any
Mode = Literal["auto", "scan", "loop"]
MODES = ("auto", "scan", "loop")
# The depth where the loop stops paying for the GPT on a CPU: beyond it the loop's compile time grows with every
# layer while scan's stays flat, and its step is no faster (docs/benchmarks.md, "Scan, loop or auto").
AUTO_LOOP_DEPTH = 6


def layer_keys(key: PRNGKeyArray, n: int) -> Key[Array, " n"] | UInt32[Array, "n 2"]:
    """n keys stacked on a leading axis, key i = `fold_in(key, i)`."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))


def init(key: PRNGKeyArray, n: int, init_fn: Callable[[PRNGKeyArray], PyTree]) -> PyTree:
    """`init_fn(fold_in(key, i))` for i in range(n), stacked on a new leading axis, in one vmapped trace."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"stack.init: n must be a positive int (the number of layers), got {n!r}")
    return jax.vmap(init_fn)(layer_keys(key, n))


def depth(stacked: PyTree, name: str = "stacked") -> int:
    """The length of the leading layer axis, which every leaf of `stacked` must share."""
    return check_same_leading_axis("stack", stacked, name, hint="build it with stack.init or stack.stack")


def scan(
    block_apply: Callable[..., Any],
    stacked: PyTree,
    x: PyTree,
    *,
    xs: PyTree = None,
    unroll: int | bool = 1,
) -> Any:
    """Run `block_apply` once per layer under `lax.scan`; `x` is the carry (any pytree: activations, a
    running loss). Returns `x`, or `(x, ys)` with `xs` (see the module docstring). `unroll` is lax.scan's."""
    n = depth(stacked)
    if xs is None:
        return jax.lax.scan(lambda x, p: (block_apply(p, x), None), x, stacked, unroll=unroll)[0]
    _check_xs(xs, n)
    return jax.lax.scan(lambda x, pxs: block_apply(pxs[0], x, pxs[1]), x, (stacked, xs), unroll=unroll)


def resolve(mode: str, n: int, *, remat: bool = False) -> Literal["scan", "loop"]:
    """The way to run `n` layers: `mode` itself, or for "auto" "loop" when n <= AUTO_LOOP_DEPTH and the blocks
    are not rematerialised, else "scan". With `remat` (a block under jax.checkpoint) "auto" scans: XLA:CPU
    schedules an unrolled loop's recomputation away (a 4-layer GPT's scratch memory, "block" against "none":
    20.4 against 20.1 MB as a loop, 5.9 against 15.9 MB under scan)."""
    if mode not in MODES:
        raise ValueError(f"stack: mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "loop" if n <= AUTO_LOOP_DEPTH and not remat else "scan"
    return mode


def apply(mode: str, block_apply: Callable[..., Any], stacked: PyTree, x: PyTree, *, xs: PyTree = None) -> Any:
    """`scan` or `loop` (over `unstack(stacked)`: slices, free under jit) as `resolve(mode, depth)` says; both
    take the stacked params, called and returning as `scan` does. For a rematerialised block pass the mode
    `resolve(mode, n, remat=True)` gives."""
    if resolve(mode, depth(stacked)) == "scan":
        return scan(block_apply, stacked, x, xs=xs)
    return loop(block_apply, unstack(stacked), x, xs=xs)


def run(
    layer: Callable[[PyTree, PyTree, PRNGKeyArray | None], PyTree],
    stacked: PyTree,
    x: PyTree,
    *,
    mode: str = "auto",
    remat: str = "none",
    key: PRNGKeyArray | None = None,
    wrap: Callable[[Callable], Callable] | None = None,
) -> Any:
    """A model's blocks, the way its config says: `layer(layer_params, x, layer_key) -> x` over the stacked
    params under `remat` (purejax/nn/remat.py), as a scan or a loop (`resolve(mode, ...)`), layer i's key
    `fold_in(key, i)` (None without a key), so scan and loop drop the same units.

    `wrap` (e.g. FSDP's gather under jax.checkpoint, `purejax.parallel.gathered`) wraps the layer inside the
    remat; a wrapped layer is recomputed in the backward pass, so "auto" scans it as a rematerialised one."""
    n = depth(stacked)
    mode = resolve(mode, n, remat=remat != "none" or wrap is not None)
    layer = remat_lib.wrap(wrap(layer) if wrap else layer, remat, prevent_cse=mode == "loop")
    if key is None:
        return apply(mode, lambda p, x: layer(p, x, None), stacked, x)
    return apply(mode, lambda p, x, k: (layer(p, x, k), None), stacked, x, xs=layer_keys(key, n))[0]


def loop(block_apply: Callable[..., Any], layers: Sequence[PyTree], x: PyTree, *, xs: PyTree = None) -> Any:
    """The same function as `scan` (equal to float32 rounding), as a Python loop over a list of per-layer
    params. `xs` is still stacked (leading layer axis) and `ys` comes back stacked, so `scan` and `loop` are
    called alike and return alike."""
    _check_layers("stack.loop", layers)
    if xs is None:
        for params in layers:
            x = block_apply(params, x)
        return x
    _check_xs(xs, len(layers))
    ys = []
    for i, params in enumerate(layers):
        x, y = block_apply(params, x, jax.tree.map(operator.itemgetter(i), xs))
        ys.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def stack(layers: Sequence[PyTree]) -> PyTree:
    """Per-layer params (all with the same paths, shapes and dtypes) stacked on a new leading axis."""
    _check_layers("stack.stack", layers)
    for i, layer in enumerate(layers[1:], start=1):
        report = tree_lib.diff(layer, layers[0])
        if not report.ok:
            raise tree_lib.TreeMismatchError(report.format(f"stack.stack: layer {i} (compared with layer 0)"))
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def unstack(stacked: PyTree) -> list[PyTree]:
    """The inverse of `stack`: a list of per-layer params, slice i of every leaf in layer i."""
    return [jax.tree.map(operator.itemgetter(i), stacked) for i in range(depth(stacked))]


def _check_layers(where: str, layers: Any) -> None:
    if not isinstance(layers, Sequence) or not layers:
        kind = f"an empty {type(layers).__name__}" if isinstance(layers, Sequence) else type(layers).__name__
        raise ValueError(f"{where}: layers must be a non-empty list of per-layer params, got {kind}")


def _check_xs(xs: PyTree, n: int) -> None:
    if depth(xs, "xs") != n:
        raise ValueError(f"stack: xs has {depth(xs, 'xs')} layers on its leading axis, but the params have {n}")
