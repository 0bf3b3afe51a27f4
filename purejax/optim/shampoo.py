"""Shampoo (Gupta et al. 2018) with the blocks, grafting and start delay of distributed Shampoo (Anil et al.
2020, "Scalable Second Order Optimization for Deep Learning"). docs/optim.md#shampoo explains each choice.

Each parameter is preconditioned as a matrix, one block G of it at a time. Per block, at step t:

    L = d * L + w * G G^T      R = d * R + w * G^T G      (d = stats_decay; w = 1 - d, or 1 for d = 1: a sum)
    every `precondition_every` steps (under lax.cond):   P_L = L^(-1/p),  P_R = R^(-1/p)    (matrix_roots)
    direction = P_L M P_R,     M = mu / (1 - b1**t),     mu = b1 * mu + (1 - b1) * g        (Adam's momentum)
    update = direction * |graft| / |direction|      per parameter, per layer of a stacked one (Anil et al. 4.1)

`graft` is Adam's `M / (sqrt(nu_hat) + eps)` or SGD's `M`; before `start_preconditioning_step`, and for 1-D
parameters and those with a side over `max_dim`, the update is the graft itself. How a parameter of any rank,
stacked or split over a mesh, becomes blocks of a matrix is `purejax.optim.shampoo_blocks`. The names `mu` and
`nu` (the momentum and the graft's second moment) are optax's; `stats_decay`, `matrix_eps` and
`start_preconditioning_step` follow distributed Shampoo's code.

On a mesh, `axis_name` (the data axis) shares the roots of the statistics every device holds alike out over
its devices, with one all-gather (`matrix_roots.inverse_pth_roots`). With `param_specs`, a device holding a
slice of a parameter (FSDP, tensor parallelism) preconditions that slice's blocks, which must be whole blocks
of the matrix, and `psum`s the grafting norms: the one-device result. The state is laid out like the params
(`stats.left.<param path>`), so `parallel.state_specs` splits it as its parameter, block grid for matrix.
"""

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from purejax import tree as tree_lib
from purejax.optim.base import GradientTransformation, PyTree, Schedule, chain, safe_increment, zero_count
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.matrix_roots import inverse_pth_roots
from purejax.optim.shampoo_blocks import BlockLayout, block_layout, per_block
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
        return [
            block_layout(path, leaf.shape, prefixes, block_size, max_dim, spec)
            for (path, leaf), spec in zip(flat.items(), specs)
        ]

    def init(params: PyTree) -> ShampooState:
        treedef, param_layouts = jax.tree.structure(params), layouts(params)
        stats = [per_block(layout, lambda side: jnp.zeros((side, side), jnp.float32)) for layout in param_layouts]
        identities = [per_block(layout, lambda side: jnp.eye(side, dtype=jnp.float32)) for layout in param_layouts]
        nu = jax.tree.map(jnp.zeros_like, params) if graft == "adam" else None
        mu = jax.tree.map(jnp.zeros_like, params)
        return ShampooState(zero_count(), mu, nu, _to_kronecker(stats, treedef), _to_kronecker(identities, treedef))

    def update(updates: PyTree, state: ShampooState, params: PyTree = None) -> tuple[PyTree, ShampooState]:
        del params
        grads, treedef = jax.tree.flatten(updates)
        param_layouts, count = layouts(updates, param_specs), safe_increment(state.count)
        nu = treedef.flatten_up_to(state.nu) if graft == "adam" else None
        mu, momentum, nu, grafts = _moments(grads, treedef.flatten_up_to(state.mu), nu, count, b1, b2, eps)
        old_stats = _left_right_pairs(state.stats, treedef)
        stats = [_accumulate(*args, stats_decay) for args in zip(old_stats, param_layouts, grads)]

        started = state.count >= start_preconditioning_step
        due = started & ((state.count - start_preconditioning_step) % precondition_every == 0)
        kept = _left_right_pairs(state.preconditioners, treedef)
        roots = jax.lax.cond(
            due, lambda: _roots(param_layouts, stats, inverse_root, matrix_eps, axis_name), lambda: kept
        )

        def precondition() -> list[Array]:
            return [_precondition_at_graft_length(*args) for args in zip(param_layouts, roots, momentum, grafts)]

        chosen = jax.lax.cond(started, precondition, lambda: grafts)
        new_updates = [new.astype(grad.dtype) for new, grad in zip(chosen, grads)]
        nu = None if nu is None else treedef.unflatten(nu)
        new_state = ShampooState(
            count, treedef.unflatten(mu), nu, _to_kronecker(stats, treedef), _to_kronecker(roots, treedef)
        )
        return treedef.unflatten(new_updates), new_state

    return GradientTransformation(init, update)


def _left_right_pairs(kronecker: Kronecker, treedef: Any) -> list[tuple[Any, Any]]:
    """Per parameter (flattened), its (left, right) matrices."""
    return list(zip(treedef.flatten_up_to(kronecker.left), treedef.flatten_up_to(kronecker.right)))


def _to_kronecker(pairs: list[tuple[Any, Any]], treedef: Any) -> Kronecker:
    """The inverse of `_left_right_pairs`: the params' tree of left matrices and that of right ones."""
    return Kronecker(treedef.unflatten([left for left, _ in pairs]), treedef.unflatten([right for _, right in pairs]))


def _moments(
    grads: list, mu: list, nu: list | None, count: Array, b1: ArrayLike, b2: ArrayLike, eps: ArrayLike
) -> tuple:
    """The new momentum and second moment (in their own dtypes), the debiased momentum M, and the graft."""
    mu = [(b1 * old + (1 - b1) * grad).astype(old.dtype) for grad, old in zip(grads, mu)]
    momentum = [(new / (1 - b1**count)).astype(jnp.float32) for new in mu]
    if nu is None:
        return mu, momentum, None, momentum
    nu = [(b2 * old + (1 - b2) * jnp.square(grad)).astype(old.dtype) for grad, old in zip(grads, nu)]
    adam = [debiased / (jnp.sqrt(second / (1 - b2**count)) + eps) for debiased, second in zip(momentum, nu)]
    return mu, momentum, nu, adam


def _accumulate(stats: tuple, layout: BlockLayout | None, grad: Array, decay: ArrayLike) -> tuple:
    """(L, R) <- (d L + w G G^T, d R + w G^T G) per block (w = 1 - d, or 1 for d = 1: a sum)."""
    if layout is None:
        return stats
    blocks, weight = layout.blocks(grad), jnp.where(decay == 1, 1.0, 1.0 - decay)
    row_products = jnp.einsum("...ij,...kj->...ik", blocks, blocks)  # G G^T
    column_products = jnp.einsum("...ji,...jk->...ik", blocks, blocks)  # G^T G
    return decay * stats[0] + weight * row_products, decay * stats[1] + weight * column_products


def _roots(
    layouts: list, stats: list, inverse_root: int, matrix_eps: ArrayLike, axis_name: Hashable
) -> list[tuple[Array, Array] | tuple[None, None]]:
    """The inverse p-th roots (p = `inverse_root`) of every (left, right) pair: those every device holds alike
    shared out over `axis_name`, those of parameters split over it (each device its own blocks) computed where
    they are."""
    roots = list(stats)
    for shared in (True, False):
        chosen = [
            index
            for index, layout in enumerate(layouts)
            if layout is not None and (axis_name not in layout.split_over) == shared
        ]
        matrices = [matrix for index in chosen for matrix in stats[index]]
        computed = iter(inverse_pth_roots(matrices, inverse_root, matrix_eps, axis_name if shared else None))
        for index in chosen:
            roots[index] = (next(computed), next(computed))
    return roots


def _precondition_at_graft_length(layout: BlockLayout | None, roots: tuple, momentum: Array, graft: Array) -> Array:
    """`P_L M P_R` per block, rescaled to the graft's norm per layer; the graft itself where not preconditioned."""
    if layout is None:
        return graft
    direction = layout.merge(roots[0] @ layout.blocks(momentum) @ roots[1])
    axes = tuple(range(layout.layers, len(layout.shape)))  # per layer of a stacked leaf

    def norm(x: Array) -> Array:  # of the whole parameter: summed over the devices holding its slices
        squares = jnp.sum(jnp.square(x), axis=axes, keepdims=True)
        return jnp.sqrt(jax.lax.psum(squares, layout.split_over) if layout.split_over else squares)

    direction_norm = norm(direction)
    safe_norm = jnp.where(direction_norm > 0, direction_norm, 1.0)
    return direction * jnp.where(direction_norm > 0, norm(graft) / safe_norm, 0.0)


def _check_settings(
    block_size: int,
    precondition_every: int,
    start_preconditioning_step: int,
    graft: str,
    inverse_root: int,
    max_dim: int,
) -> None:
    """Fail at construction, naming the argument, rather than at the first step."""
    for name, value, least in [
        ("block_size", block_size, 1),
        ("precondition_every", precondition_every, 1),
        ("start_preconditioning_step", start_preconditioning_step, 0),
        ("inverse_root", inverse_root, 1),
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
