"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"): momentum, orthogonalised.

For a weight matrix W of shape (d_in, d_out) (purejax's `x @ w` layout) with gradient G, at step t (1 first):

    M = beta * M + (1 - beta) * G                    M_hat = M / (1 - beta**t)
    update = sqrt(max(1, d_out / d_in)) * NS5(M_hat),   NS5(M_hat) ~ U V^T where M_hat = U S V^T

With `nesterov=True` (the default, as in optax and Keller Jordan's code) the momentum looks one step ahead,
as NAdam's does: `M_hat = beta * M / (1 - beta**(t+1)) + (1 - beta) * G / (1 - beta**t)`. The bias correction
is optax's; Keller Jordan's torch Muon has none (it only changes the first few steps' size).

U V^T is the steepest-descent direction under the spectral norm (Bernstein & Newhouse 2024, "Old Optimizer, New
Norm"): every singular direction of the momentum moves by the same amount, so the rare directions are not
drowned by the dominant ones. NS5 approximates it by five Newton-Schulz steps, matrix products only:

    X_0 = M_hat / (||M_hat||_F + eps)            (every singular value now in [0, 1])
    X_{k+1} = a X_k + b (X_k X_k^T) X_k + c (X_k X_k^T)^2 X_k,     (a, b, c) = (3.4445, -4.7750, 2.0315)

A step maps each singular value s to p(s) = a s + b s^3 + c s^5 and keeps the singular vectors. Keller
Jordan's quintic maximises the slope at 0 (small singular values grow 3.4445x per step) at the price of not
converging to exactly 1: after 5 steps every singular value that started at least 1% of the Frobenius norm
lies in [0.68, 1.14], which trains as well as U V^T itself. It runs in the momentum's dtype, as in optax
(float32 for float32 parameters; Keller Jordan's reference casts to bfloat16 first).

The shape factor sqrt(max(1, d_out / d_in)) is Keller Jordan's (optax's default `scale_by_shape`); with
`consistent_rms=r` it is `r * sqrt(max(d_in, d_out))` instead (Liu et al. 2025, "Muon is Scalable for LLM
Training": r = 0.2 gives AdamW's update RMS, so AdamW's learning rate and weight decay carry over).

Muon is for the hidden matrices only: `muon` sends the leaves `matrices` selects to it and all others (biases,
norm scales, and by Keller Jordan's advice embeddings and the output head) to AdamW, as `optax.contrib.muon`
does. A selected leaf of shape (..., d_in, d_out) is a stack of matrices, one per index of its leading axes
(the GPT's blocks stacked on n_layer), each orthogonalised on its own (vmap). docs/optim.md, section "Muon".

Every matrix must be whole on the device that updates it: under `shard_map` with tensor parallelism or FSDP
a device holds a slice, and Newton-Schulz on a slice is not Newton-Schulz on the matrix (data parallelism,
params replicated, is fine).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Float, Int

from purejax import tree as tree_lib
from purejax.optim.adam import scale_by_adam
from purejax.optim.base import (
    GradientTransformation,
    PyTree,
    Schedule,
    bias_correction,
    chain,
    safe_increment,
    zero_count,
)
from purejax.optim.learning_rate import scale_by_learning_rate
from purejax.optim.weight_decay import Mask, add_decayed_weights, ndim_at_least, resolve_mask

KELLER_JORDAN_COEFFS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients (a, b, c) of Keller Jordan's Muon and optax's default."""


def newton_schulz(
    x: Float[Array, "*layers d_in d_out"],
    coeffs: tuple[ArrayLike, ArrayLike, ArrayLike] = KELLER_JORDAN_COEFFS,
    steps: int = 5,
    eps: ArrayLike = 1e-8,
) -> Float[Array, "*layers d_in d_out"]:
    """Approximately U V^T for each matrix x = U S V^T in the last two axes (the module docstring has the
    iteration): singular vectors kept, singular values pulled into about [0.68, 1.14].

    Computed in x's dtype. A tall matrix is transposed first, so that X X^T is the smaller of the two Gram
    matrices (the iteration commutes with transposition)."""
    if x.ndim < 2:
        raise ValueError(f"newton_schulz orthogonalises matrices: got shape {x.shape}, which has fewer than 2 axes")
    d_in, d_out = x.shape[-2:]
    one = jax.vmap(lambda m: _newton_schulz_one(m, coeffs, steps, eps))
    return one(x.reshape(-1, d_in, d_out)).reshape(x.shape)


def _newton_schulz_one(x: Array, coeffs: tuple, steps: int, eps: ArrayLike) -> Array:
    a, b, c = (jnp.asarray(k, x.dtype) for k in coeffs)  # in x's dtype even when given as float32 arrays
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (jnp.linalg.norm(x) + eps).astype(x.dtype)  # ||x||_F >= ||x||_2: singular values now in [0, 1]
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def shape_factor(d_in: int, d_out: int, consistent_rms: ArrayLike | None = None) -> ArrayLike:
    """The factor an orthogonalised (d_in, d_out) update is multiplied by: sqrt(max(1, d_out / d_in)) (Keller
    Jordan), or `consistent_rms * sqrt(max(d_in, d_out))` (Liu et al. 2025) when that is given."""
    if consistent_rms is None:
        return math.sqrt(max(1.0, d_out / d_in))
    return consistent_rms * math.sqrt(max(d_in, d_out))


class MuonState(NamedTuple):
    """Steps taken, and the momentum `mu`, one array per (stack of) matrices."""

    count: Int[Array, ""]
    mu: PyTree


def scale_by_muon(
    ns_coeffs: tuple[ArrayLike, ArrayLike, ArrayLike] = KELLER_JORDAN_COEFFS,
    ns_steps: int = 5,
    beta: ArrayLike = 0.95,
    eps: ArrayLike = 1e-8,
    mu_dtype: DTypeLike | None = None,
    *,
    nesterov: bool = True,
    consistent_rms: ArrayLike | None = None,
) -> GradientTransformation:
    """Replace updates by Muon's: the shape-scaled orthogonalised momentum (no learning rate, no sign flip).

    Every leaf must be a matrix, or a stack of them on leading axes; `muon` routes the others to AdamW.

    Arguments:
        ns_coeffs, ns_steps: the Newton-Schulz polynomial's (a, b, c) and how many steps to take.
        beta: decay rate of the momentum.
        eps: added to the Frobenius norm that Newton-Schulz divides by first.
        mu_dtype: dtype of the momentum; default: each parameter's dtype.
        nesterov: look one step ahead, as optax's `nesterov`.
        consistent_rms: None for Keller Jordan's shape factor, else Liu et al.'s RMS (`shape_factor`).
    """

    def init(params: PyTree) -> MuonState:
        return MuonState(zero_count(), jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params))

    def update(updates: PyTree, state: MuonState, params: PyTree = None) -> tuple[PyTree, MuonState]:
        del params
        mu = jax.tree_util.tree_map(lambda g, m: (1 - beta) * g + beta * m, updates, state.mu)
        count = safe_increment(state.count)
        if nesterov:
            ahead, now = bias_correction(mu, beta, safe_increment(count)), bias_correction(updates, beta, count)
            mu_hat = jax.tree_util.tree_map(lambda m, g: beta * m + (1 - beta) * g, ahead, now)
        else:
            mu_hat = bias_correction(mu, beta, count)
        updates = jax.tree_util.tree_map_with_path(lambda path, m: orthogonalise(tree_lib.path_to_str(path), m), mu_hat)
        mu = jax.tree_util.tree_map(lambda m, old: m.astype(old.dtype), mu, state.mu)
        return updates, MuonState(count, mu)

    def orthogonalise(path: str, m: Array) -> Array:
        if m.ndim < 2:
            raise ValueError(
                f"scale_by_muon: {path} has shape {m.shape}, not a matrix (nor a stack of them); Muon is for "
                f"matrices: leave it out with muon(..., matrices=...), which sends it to AdamW"
            )
        return shape_factor(*m.shape[-2:], consistent_rms) * newton_schulz(m, ns_coeffs, ns_steps, eps)

    return GradientTransformation(init, update)


def matrix_leaves(*, stacked: Sequence[str] = (), exclude: Sequence[str] = ()) -> Callable[[str, Any], bool]:
    """A predicate `(path, leaf) -> bool` selecting the leaves that are exactly 2-D per layer, except those at or
    under the dotted paths in `exclude`: the matrices `muon` gives to Muon.

    `matrix_leaves()` is optax's default rule (every 2-D leaf). For a transformer follow Keller Jordan: exclude
    the embeddings and the output head, and name the stacked blocks so their (n_layer, d_in, d_out) weights
    count as matrices and their (n_layer, d_model) LayerNorm scales do not (`ndim_at_least`'s `stacked`):

        matrix_leaves(stacked=("blocks",), exclude=("wte", "wpe"))   # purejax's GPT (the head is wte)
    """
    two, three = ndim_at_least(2, stacked=stacked), ndim_at_least(3, stacked=stacked)
    excluded = (exclude,) if isinstance(exclude, str) else tuple(exclude)

    def predicate(path: str, leaf: Any) -> bool:
        if any(path == e or path.startswith(e + ".") for e in excluded):
            return False
        return two(path, leaf) and not three(path, leaf)

    return predicate


def _only(select: Callable[[PyTree], PyTree], transform: GradientTransformation) -> GradientTransformation:
    """`transform` on the leaves `select(tree)` marks True; the others pass through untouched and get no state.

    The transform sees a tree with None where the unselected leaves were (an empty node to jax and to
    checkpoints), so its state keeps the params' paths and only the selected leaves' arrays: Muon's momentum
    holds the matrices, Adam's moments the rest. This is optax's `partition` without its `MaskedNode`."""

    def init(params: PyTree) -> PyTree:
        return transform.init(_prune(params, select(params)))

    def update(updates: PyTree, state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
        selected = select(updates)  # from paths and shapes: the updates will do when params are not given
        pruned = None if params is None else _prune(params, selected)
        new, state = transform.update(_prune(updates, selected), state, pruned)
        merged = jax.tree_util.tree_map(lambda n, u: u if n is None else n, new, updates, is_leaf=lambda x: x is None)
        return merged, state

    return GradientTransformation(init, update)


def _prune(tree: PyTree, selected: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x, s: x if s else None, tree, selected)


def _where(matrices: Mask, *, matrix: bool, mask: Mask = None) -> Callable[[PyTree], PyTree]:
    """`tree -> bools`: the leaves that are Muon matrices (or, with matrix=False, are not) and that `mask` selects."""
    if matrices is None:
        matrices = matrix_leaves()

    def select(tree: PyTree) -> PyTree:
        is_matrix, masked = resolve_mask(matrices, tree), resolve_mask(mask, tree)
        return jax.tree_util.tree_map(lambda m, s: m == matrix and s, is_matrix, masked)

    return select


def muon(
    learning_rate: ArrayLike | Schedule,
    ns_coeffs: tuple[ArrayLike, ArrayLike, ArrayLike] = KELLER_JORDAN_COEFFS,
    ns_steps: int = 5,
    beta: ArrayLike = 0.95,
    eps: ArrayLike = 1e-8,
    weight_decay: ArrayLike = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adam_b1: ArrayLike = 0.9,
    adam_b2: ArrayLike = 0.999,
    adam_eps_root: ArrayLike = 0.0,
    adam_weight_decay: ArrayLike = 0.0,
    adam_weight_decay_mask: Mask = None,
    adam_learning_rate: ArrayLike | Schedule | None = None,
    matrices: Mask = None,
    consistent_rms: ArrayLike | None = None,
) -> GradientTransformation:
    """Muon on the leaves `matrices` selects, AdamW (NAdam when `nesterov`, as optax) on the others.

    The arguments are `optax.contrib.muon`'s, with the same defaults, and the result equals it step for step
    (tests/purejax/optim/test_muon.py); `matrices` takes the place of `muon_weight_dimension_numbers`.

    Arguments:
        learning_rate: Muon's rate (a number or a schedule); `get_learning_rate` reports this one.
        ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov, consistent_rms: as `scale_by_muon`; `eps`,
            `mu_dtype` and `nesterov` also go to Adam, as in optax.
        weight_decay, weight_decay_mask: decoupled decay on the Muon matrices (those of them the mask selects).
        adam_b1, adam_b2, adam_eps_root: Adam's, for the other leaves.
        adam_weight_decay, adam_weight_decay_mask: decoupled decay on the Adam leaves; the mask is purejax's
            addition (optax decays all of them), so nanoGPT's `ndim_at_least(2)` can spare biases and norms.
        adam_learning_rate: the Adam leaves' rate; default: `learning_rate`.
        matrices: which leaves are Muon matrices: a tree of bools or a predicate `(path, leaf) -> bool` such
            as `matrix_leaves(stacked=("blocks",), exclude=("wte", "wpe"))`; default `matrix_leaves()`,
            every 2-D leaf, as optax. The last two axes of a selected leaf are the matrix, any before a stack.

    State paths: `muon.count`, `muon.mu.*` (the matrices), `adam.count`, `adam.mu.*`, `adam.nu.*` (the
    others), `lr.*` (Muon's rate) and `lr_adam.*`; `set_learning_rate` sets both rates.
    """
    adam_learning_rate = learning_rate if adam_learning_rate is None else adam_learning_rate
    on_matrices, on_others = _where(matrices, matrix=True), _where(matrices, matrix=False)
    by_muon = scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, consistent_rms=consistent_rms)
    by_adam = scale_by_adam(adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, nesterov=nesterov)
    return chain(
        muon=_only(on_matrices, by_muon),
        adam=_only(on_others, by_adam),
        weight_decay=_only(_where(matrices, matrix=True, mask=weight_decay_mask), add_decayed_weights(weight_decay)),
        weight_decay_adam=_only(
            _where(matrices, matrix=False, mask=adam_weight_decay_mask), add_decayed_weights(adam_weight_decay)
        ),
        lr=_only(on_matrices, scale_by_learning_rate(learning_rate)),  # sorts before lr_adam: get_learning_rate's
        lr_adam=_only(on_others, scale_by_learning_rate(adam_learning_rate)),
    )
