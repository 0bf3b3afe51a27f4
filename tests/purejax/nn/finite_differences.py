"""Central finite differences in float64: the independent gradient the layer tests compare `jax.grad` with."""

import jax
import numpy as np


def gradient(f, tree, eps=1e-6):
    """d f / d tree by central differences, one entry of one leaf at a time: `f` maps a pytree of float64
    arrays (or one array) shaped like `tree` to a scalar; the result is shaped like `tree`."""
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda a: np.asarray(a, np.float64), tree))
    grads = []
    for i, leaf in enumerate(leaves):
        grad = np.zeros_like(leaf)
        for index in np.ndindex(leaf.shape):
            shifted = []
            for sign in (1.0, -1.0):
                moved = leaf.copy()
                moved[index] += sign * eps
                shifted.append(f(jax.tree.unflatten(treedef, leaves[:i] + [moved] + leaves[i + 1 :])))
            grad[index] = (shifted[0] - shifted[1]) / (2 * eps)
        grads.append(grad)
    return jax.tree.unflatten(treedef, grads)
