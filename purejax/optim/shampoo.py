"""Shampoo (Gupta et al. 2018) with the blocks, grafting and start delay of distributed Shampoo (Anil et al.
2020, "Scalable Second Order Optimization for Deep Learning"). docs/optim.md#shampoo explains each choice.

Each parameter is preconditioned as a matrix, one block G of it at a time. Per block, at step t:

    L = d * L + w * G G^T      R = d * R + w * G^T G      (d = stats_decay; w = 1 - d, or 1 for d = 1: a sum)
    every `precondition_every` steps (under lax.cond):   P_L = L^(-1/p),  P_R = R^(-1/p)    (matrix_roots)
    direction = P_L M P_R,     M = mu / (1 - b1**t),     mu = b1 * mu + (1 - b1) * g        (Adam's momentum)
    update = direction * |graft| / |direction|      per parameter, per layer of a stacked one (Anil et al. 4.1)

`graft` is Adam's `M / (sqrt(nu_hat) + eps)` or SGD's `M`; before `start_preconditioning_step`, and for 1-D
parameters and those with a side over `max_dim`, the update is the graft itself. A tensor of more dimensions
is the matrix (all dims but the last merged, the last): a HWIO kernel is (kh * kw * in, out). Leaves under
`stacked` prefixes have a leading layer axis: a batch of matrices. Sides over `block_size` are cut into blocks,
the last zero-padded (a zero row of G adds a decoupled zero row and column to L: nothing changes).

On a mesh, `axis_name` (the data axis) shares the roots of the statistics every device holds alike out over
its devices, with one all-gather (`matrix_roots.inverse_pth_roots`). With `param_specs`, a device holding a
slice of a parameter (FSDP, tensor parallelism) preconditions that slice's blocks, which must be whole blocks
of the matrix, and `psum`s the grafting norms: the one-device result. The state is laid out like the params
(`stats.left.<param path>`), so `parallel.state_specs` splits it as its parameter, block grid for matrix.
"""

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from purejax import tree as tree_lib
from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain, safe_increment, zero_count
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.matrix_roots import inverse_pth_roots
from purejax.optim.weight_decay import Mask, add_decayed_weights


class Kronecker(NamedTuple):
    """Per parameter (the params' tree; None where not preconditioned) the left and right matrix of each block,
    `(*layers, row_blocks, col_blocks, side, side)`: the statistics, or their inverse roots."""

    left: PyTree
    right: PyTree


class ShampooState(NamedTuple):
    """Steps taken; per parameter the momentum `mu` and the Adam graft's second moment `nu` (None for SGD); and
    the `stats` (L, R) and `preconditioners` (their inverse roots)."""

    count: Int[Array, ""]
    mu: PyTree
    nu: PyTree
    stats: Kronecker
    preconditioners: Kronecker


@dataclass(frozen=True)
class BlockLayout:
    """A parameter (this device's slice of it, on a mesh) seen as `layers` leading axes, then a (rows, cols)
    matrix per layer cut into (row_block, col_block) blocks."""

    shape: tuple[int, ...]
    layers: int
    rows: int
    cols: int
    row_block: int
    col_block: int
    split_over: tuple[str, ...] = ()  # the mesh axes the parameter is split over

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.rows // self.row_block), -(-self.cols // self.col_block)

    def blocks(self, x: Array) -> Float[Array, "*layers row_blocks col_blocks rows cols"]:
        lead, (nr, nc), rb, cb = self.shape[: self.layers], self.grid, self.row_block, self.col_block
        m = x.astype(jnp.float32).reshape(*lead, self.rows, self.cols)
        m = jnp.pad(m, [(0, 0)] * self.layers + [(0, nr * rb - self.rows), (0, nc * cb - self.cols)])
        return jnp.swapaxes(m.reshape(*lead, nr, rb, nc, cb), -3, -2)

    def merge(self, b: Float[Array, "*layers row_blocks col_blocks rows cols"]) -> Array:
        lead, (nr, nc) = self.shape[: self.layers], self.grid
        m = jnp.swapaxes(b, -3, -2).reshape(*lead, nr * self.row_block, nc * self.col_block)
        return m[..., : self.rows, : self.cols].reshape(self.shape)


def block_layout(
    name: str, shape: Sequence[int], stacked: Sequence[str], block_size: int, max_dim: int, spec: Sequence[Any] = ()
) -> BlockLayout | None:
    """The layout of the parameter `name` (this device's `shape` of it, split as `spec` says, inside
    `shard_map`; a leading layer axis per `stacked` prefix it lies under), or None if Shampoo leaves it to the
    graft: fewer than two dims per layer, or a side of the whole matrix over `max_dim`. Raises when a device's
    slice is not made of whole blocks of the whole matrix."""
    layers = sum(name == p or name.startswith(p + ".") for p in stacked)
    if len(shape) < layers:
        raise ValueError(
            f"scale_by_shampoo(stacked={tuple(stacked)}): {name} has shape {tuple(shape)}, so it has "
            f"no leading layer axis: is it really under a stacked subtree?"
        )
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in (*spec, *[None] * (len(shape) - len(spec)))]
    splits = [math.prod(jax.lax.axis_size(a) for a in axes) for axes in entries]
    full = [n * k for n, k in zip(shape, splits)]
    if len(shape) - layers < 2 or max(math.prod(full[layers:-1]), full[-1]) > max_dim:
        return None
    rows, cols = math.prod(shape[layers:-1]), shape[-1]
    rb, cb = min(math.prod(full[layers:-1]), block_size), min(full[-1], block_size)
    misaligned = any(k > 1 for k in splits[layers + 1 : -1]) or (splits[layers] > 1 and rows % rb)
    if misaligned or (splits[-1] > 1 and cols % cb):
        raise ValueError(
            f"scale_by_shampoo: {name} {tuple(full)} is split {tuple(spec)} over the mesh, so a device holds "
            f"{rows} x {cols} of its {math.prod(full[layers:-1])} x {full[-1]} matrix, which blocks of {rb} x {cb} "
            f"do not tile as they tile the whole (a split dim must be the first or the last of a layer's): pick "
            f"a block_size dividing the slice, or leave the parameter to the graft (max_dim)"
        )
    return BlockLayout(tuple(shape), layers, rows, cols, rb, cb, tuple(a for axes in entries for a in axes))


def scale_by_shampoo(
    block_size: int = 128,
    *,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    stats_decay: ArrayLike = 0.999,
    matrix_eps: ArrayLike = 1e-5,
    precondition_every: int = 10,
    start_preconditioning_step: int = 10,
    graft: str = "adam",
    inverse_root: int = 4,
    max_dim: int = 4096,
    stacked: Sequence[str] = (),
    axis_name: Hashable = None,
    param_specs: PyTree = None,
) -> GradientTransformation:
    """Shampoo's preconditioned momentum at the grafted optimizer's per-layer length (module docstring); no
    learning rate, no sign flip.

    Arguments:
        block_size: the largest side of a block; longer sides are cut (Anil et al. use 128 to 1024).
        b1: momentum decay (0: none). b2, eps: the Adam graft's second-moment decay and denominator epsilon.
        stats_decay: decay of the statistics L and R; 1.0 sums them, as Gupta et al. do.
        matrix_eps: damping of the roots, relative to each statistic's largest eigenvalue.
        precondition_every: recompute the roots every this many steps (the first at the start).
        start_preconditioning_step: the number of first steps that use the graft alone.
        graft: "adam" or "sgd": the optimizer whose update length per layer Shampoo's direction keeps.
        inverse_root: p in L^(-1/p) and R^(-1/p); 4 is the paper's 1/(2k) for matrices (k = 2).
        max_dim: parameters with a (merged) side longer than this get the graft alone.
        stacked: dotted paths of subtrees whose leaves have a leading layer axis, e.g. ("blocks",).
        axis_name: inside `shard_map`, the data axis to share the root computations out over.
        param_specs: inside `shard_map`, the params' PartitionSpecs when some are split (FSDP, tensor
            parallelism; without them a device's slice is taken for a whole parameter). Not needed otherwise.
    """
    _check_settings(block_size, precondition_every, start_preconditioning_step, graft, inverse_root, max_dim)
    prefixes = (stacked,) if isinstance(stacked, str) else tuple(stacked)

    def layouts(tree: PyTree, specs: PyTree = None) -> list[BlockLayout | None]:
        flat = tree_lib.flatten(tree)
        specs = [()] * len(flat) if specs is None else jax.tree.structure(tree).flatten_up_to(specs)
        return [block_layout(k, x.shape, prefixes, block_size, max_dim, s) for (k, x), s in zip(flat.items(), specs)]

    def init(params: PyTree) -> ShampooState:
        treedef, lays = jax.tree.structure(params), layouts(params)
        stats = [_per_block(lay, lambda k: jnp.zeros((k, k), jnp.float32)) for lay in lays]
        eyes = [_per_block(lay, lambda k: jnp.eye(k, dtype=jnp.float32)) for lay in lays]
        nu = jax.tree.map(jnp.zeros_like, params) if graft == "adam" else None
        mu = jax.tree.map(jnp.zeros_like, params)
        return ShampooState(zero_count(), mu, nu, _kronecker(stats, treedef), _kronecker(eyes, treedef))

    def update(updates: PyTree, state: ShampooState, params: PyTree = None) -> tuple[PyTree, ShampooState]:
        del params
        grads, treedef = jax.tree.flatten(updates)
        lays, count = layouts(updates, param_specs), safe_increment(state.count)
        nu = treedef.flatten_up_to(state.nu) if graft == "adam" else None
        mu, momentum, nu, grafts = _moments(grads, treedef.flatten_up_to(state.mu), nu, count, b1, b2, eps)
        stats = [_accumulate(s, lay, g, stats_decay) for s, lay, g in zip(_pairs(state.stats, treedef), lays, grads)]

        started = state.count >= start_preconditioning_step
        due = started & ((state.count - start_preconditioning_step) % precondition_every == 0)
        kept = _pairs(state.preconditioners, treedef)
        roots = jax.lax.cond(due, lambda: _roots(lays, stats, inverse_root, matrix_eps, axis_name), lambda: kept)

        def precondition() -> list[Array]:
            return [_graft(lay, r, m, a) for lay, r, m, a in zip(lays, roots, momentum, grafts)]

        new = [u.astype(g.dtype) for u, g in zip(jax.lax.cond(started, precondition, lambda: grafts), grads)]
        nu = None if nu is None else treedef.unflatten(nu)
        new_state = ShampooState(
            count, treedef.unflatten(mu), nu, _kronecker(stats, treedef), _kronecker(roots, treedef)
        )
        return treedef.unflatten(new), new_state

    return GradientTransformation(init, update)


def _per_block(lay: BlockLayout | None, make: Any) -> tuple[Array, Array] | tuple[None, None]:
    """(left, right): `make(side)` for each block of a preconditioned parameter; (None, None) for another."""
    if lay is None:
        return None, None
    lead = (*lay.shape[: lay.layers], *lay.grid)
    return tuple(jnp.broadcast_to(make(k), (*lead, k, k)) for k in (lay.row_block, lay.col_block))


def _pairs(kronecker: Kronecker, treedef: Any) -> list[tuple[Any, Any]]:
    return list(zip(treedef.flatten_up_to(kronecker.left), treedef.flatten_up_to(kronecker.right)))


def _kronecker(pairs: list[tuple[Any, Any]], treedef: Any) -> Kronecker:
    return Kronecker(treedef.unflatten([p[0] for p in pairs]), treedef.unflatten([p[1] for p in pairs]))


def _moments(
    grads: list, mu: list, nu: list | None, count: Array, b1: ArrayLike, b2: ArrayLike, eps: ArrayLike
) -> tuple:
    """The new momentum and second moment (in their own dtypes), the debiased momentum M, and the graft."""
    mu = [(b1 * m + (1 - b1) * g).astype(m.dtype) for g, m in zip(grads, mu)]
    momentum = [(m / (1 - b1**count)).astype(jnp.float32) for m in mu]
    if nu is None:
        return mu, momentum, None, momentum
    nu = [(b2 * v + (1 - b2) * jnp.square(g)).astype(v.dtype) for g, v in zip(grads, nu)]
    return mu, momentum, nu, [m / (jnp.sqrt(v / (1 - b2**count)) + eps) for m, v in zip(momentum, nu)]


def _accumulate(stats: tuple, layout: BlockLayout | None, g: Array, decay: ArrayLike) -> tuple:
    """(L, R) <- (d L + w G G^T, d R + w G^T G) per block (w = 1 - d, or 1 for d = 1: a sum)."""
    if layout is None:
        return stats
    blocks, weight = layout.blocks(g), jnp.where(decay == 1, 1.0, 1.0 - decay)
    gg_t, gt_g = jnp.einsum("...ij,...kj->...ik", blocks, blocks), jnp.einsum("...ji,...jk->...ik", blocks, blocks)
    return decay * stats[0] + weight * gg_t, decay * stats[1] + weight * gt_g


def _roots(layouts: list, stats: list, p: int, eps: ArrayLike, axis_name: Hashable) -> list:
    """The inverse p-th roots of every (left, right) pair: those every device holds alike shared out over
    `axis_name`, those of parameters split over it (each device its own blocks) computed where they are."""
    out = list(stats)
    for shared in (True, False):
        mine = [i for i, lay in enumerate(layouts) if lay is not None and (axis_name not in lay.split_over) == shared]
        roots = iter(inverse_pth_roots([m for i in mine for m in stats[i]], p, eps, axis_name if shared else None))
        for i in mine:
            out[i] = (next(roots), next(roots))
    return out


def _graft(layout: BlockLayout | None, roots: tuple, momentum: Array, graft: Array) -> Array:
    """`P_L M P_R` per block, rescaled to the graft's norm per layer; the graft itself where not preconditioned."""
    if layout is None:
        return graft
    direction = layout.merge(roots[0] @ layout.blocks(momentum) @ roots[1])
    axes = tuple(range(layout.layers, len(layout.shape)))  # per layer of a stacked leaf

    def norm(x: Array) -> Array:  # of the whole parameter: summed over the devices holding its slices
        squares = jnp.sum(jnp.square(x), axis=axes, keepdims=True)
        return jnp.sqrt(jax.lax.psum(squares, layout.split_over) if layout.split_over else squares)

    d_norm = norm(direction)
    return direction * jnp.where(d_norm > 0, norm(graft) / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)


def _check_settings(block_size: int, every: int, start: int, graft: str, root: int, max_dim: int) -> None:
    for name, value, least in [
        ("block_size", block_size, 1),
        ("precondition_every", every, 1),
        ("start_preconditioning_step", start, 0),
        ("inverse_root", root, 1),
        ("max_dim", max_dim, 1),
    ]:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"scale_by_shampoo: {name} must be an int of at least {least}, got {value!r}")
    if graft not in ("adam", "sgd"):
        raise ValueError(f"scale_by_shampoo: graft must be 'adam' or 'sgd', got {graft!r}")


def shampoo(
    learning_rate: ArrayLike | Schedule,
    block_size: int = 128,
    *,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    stats_decay: ArrayLike = 0.999,
    matrix_eps: ArrayLike = 1e-5,
    precondition_every: int = 10,
    start_preconditioning_step: int = 10,
    graft: str = "adam",
    inverse_root: int = 4,
    max_dim: int = 4096,
    stacked: Sequence[str] = (),
    axis_name: Hashable = None,
    param_specs: PyTree = None,
    weight_decay: ArrayLike = 0.0,
    mask: Mask = None,
) -> GradientTransformation:
    """Shampoo, then decoupled weight decay on the leaves `mask` selects, then the learning rate; the other
    arguments are `scale_by_shampoo`'s. The learning rate is the graft's: with `graft="adam"` start from AdamW's.
    State paths: `shampoo.count`, `shampoo.mu.*`, `shampoo.nu.*`, `shampoo.stats.left|right.<param>`,
    `shampoo.preconditioners.left|right.<param>`, `lr.*` (the decay keeps none)."""
    preconditioner = scale_by_shampoo(
        block_size,
        b1=b1,
        b2=b2,
        eps=eps,
        stats_decay=stats_decay,
        matrix_eps=matrix_eps,
        precondition_every=precondition_every,
        start_preconditioning_step=start_preconditioning_step,
        graft=graft,
        inverse_root=inverse_root,
        max_dim=max_dim,
        stacked=stacked,
        axis_name=axis_name,
        param_specs=param_specs,
    )
    decay = add_decayed_weights(weight_decay, mask)
    return chain(shampoo=preconditioner, weight_decay=decay, lr=scale_by_learning_rate(learning_rate))
