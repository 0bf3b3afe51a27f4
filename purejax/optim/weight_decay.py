"""Decoupled weight decay (`updates + weight_decay * params`, Loshchilov & Hutter 2019) and the masks that say
which parameters it applies to.

A mask is either a pytree of Python bools shaped like the params, or a predicate `(path, leaf) -> bool` asked
once per leaf, e.g. nanoGPT's rule "decay matrices and embeddings, not biases or norm gains":

    adamw(3e-4, weight_decay=0.1, mask=ndim_at_least(2))
    adamw(3e-4, weight_decay=0.1, mask=ndim_at_least(2, stacked=("blocks",)))   # blocks under lax.scan

(optax's callable mask takes the whole params tree instead; pass a tree here if you already have one.)
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jaxtyping import ArrayLike

from purejax import tree as tree_lib
from purejax.optim.base import GradientTransformation, PyTree, stateless

Mask = Any
"""None (every leaf), a pytree of bools with the params' structure, or a predicate `(path: str, leaf) -> bool`."""


def resolve_mask(mask: Mask, params: PyTree) -> PyTree:
    """The mask as a pytree of Python bools with exactly the structure of `params`.

    Raises TreeMismatchError listing every path the mask tree lacks or adds, and TypeError naming the path of
    any entry that is not a Python bool (a mask is decided from names and shapes, never from array values)."""
    if mask is None:
        return jax.tree_util.tree_map(lambda _: True, params)
    if callable(mask):
        try:
            flat = {path: mask(path, leaf) for path, leaf in tree_lib.flatten(params).items()}
        except TypeError as e:
            if "positional argument" not in str(e):
                raise
            raise TypeError(
                f"a weight-decay mask function is called as mask(path, leaf) for each parameter (path: the "
                f"dotted name, e.g. 'blocks.mlp.fc.w'), not as optax's mask(params): {e}"
            ) from None
    else:
        flat = tree_lib.flatten(mask)
    bad = [f"{path} ({type(v).__name__})" for path, v in flat.items() if not isinstance(v, bool)]
    if bad:
        raise TypeError(
            f"a weight-decay mask must give a Python bool per parameter, but these entries are not: "
            f"{', '.join(bad)}; decide from names and shapes (`p.ndim >= 2`), never from array values"
        )
    return tree_lib.unflatten_like(params, flat)


def add_decayed_weights(weight_decay: ArrayLike, mask: Mask = None) -> GradientTransformation:
    """`updates + weight_decay * params` on the leaves the mask selects; the others pass through.

    Place it after the adaptive scaling and before the learning rate, as `adamw` does, so the decay is decoupled
    from the gradient statistics and still follows the learning-rate schedule."""

    def decay(updates: PyTree, params: PyTree) -> PyTree:
        if params is None:
            raise ValueError("add_decayed_weights needs the params: call update(grads, state, params)")
        selected = resolve_mask(mask, params)
        return jax.tree_util.tree_map(lambda g, p, m: g + weight_decay * p if m else g, updates, params, selected)

    return stateless(decay)


def ndim_at_least(n: int, *, stacked: Sequence[str] = ()) -> Callable[[str, Any], bool]:
    """A mask predicate selecting the leaves with at least `n` dimensions per layer.

    `ndim_at_least(2)` is nanoGPT's rule: decay weight matrices and embeddings, not biases or norm scales.
    Blocks stacked for `lax.scan` (`purejax.nn.stack`, the GPT's "blocks") give every leaf under them a leading
    layer axis, which would make their LayerNorm scales 2-D: name those subtrees in `stacked` and their leading
    axis is not counted (a leaf under two stacked prefixes, a stack in a stack, loses two axes).

    Arguments:
        n: the least number of dimensions (per layer) of a selected leaf.
        stacked: dotted paths of the subtrees whose leaves carry a leading layer axis, e.g. `("blocks",)`.
    """
    prefixes = (stacked,) if isinstance(stacked, str) else tuple(stacked)

    def predicate(path: str, leaf: Any) -> bool:
        layer_axes = sum(path == p or path.startswith(p + ".") for p in prefixes)
        if leaf.ndim < layer_axes:
            raise ValueError(
                f"ndim_at_least(stacked={prefixes}): {path} has shape {tuple(leaf.shape)}, so it has no leading "
                f"layer axis to discount: is it really under a stacked subtree?"
            )
        return leaf.ndim - layer_axes >= n

    return predicate
