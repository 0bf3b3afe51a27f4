"""Inverse p-th roots of symmetric positive semi-definite matrices, for Shampoo's preconditioners, and the same
for many matrices at once, optionally with the work spread over the devices of a mesh axis.

For a statistic A (symmetric, PSD up to rounding) with eigendecomposition A = V diag(w) V^T:

    A^(-1/p) = V diag((max(w, 0) + eps * w_max) ** (-1/p)) V^T,     w_max = the largest eigenvalue

The damping `eps * w_max` is relative (`relative_matrix_epsilon`, the default of Anil et al.'s code): it caps
the condition number at 1/eps whatever the gradients' scale. An all-zero A (a block whose gradients were all zero)
has no scale to be relative to and gets the identity: Shampoo's grafting sets the update's length anyway.

Why an eigendecomposition and not the coupled Newton iteration of Anil et al. (also Guo & Higham 2006). In
float32, `eigh` returns eigenvalues to within a small multiple of float32 epsilon (u = 6e-8) times w_max and
orthonormal eigenvectors, for any input: its error does not grow with the conditioning, and with the damping
above the root's relative error stays under about 2 sqrt(n) u / (p eps) however ill-conditioned A is
(tests/purejax/optim/test_shampoo.py; measured: 3e-2 for n = 128, eps = 1e-5 and condition number 1e12,
4e-3 with eps = 1e-4, 2e-6 for a well-conditioned A). Newton's iteration needs a number of steps that grows
with the condition number, must be rescaled to converge at all, and in float32 its error grows with the
condition number too, so an implementation must check it and fall back (Anil et al.'s keeps the old root when
the error exceeds a tolerance). `eigh` is slower than a few matmuls on accelerators, but it runs once every
`precondition_every` steps and, with `axis_name`, on 1/n of the blocks per device.
"""

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float


def inverse_pth_root(a: Float[Array, "*batch n n"], p: int, eps: ArrayLike = 1e-5) -> Float[Array, "*batch n n"]:
    """`(A + eps * w_max * I)^(-1/p)` of each symmetric PSD matrix in the batch, in float32 (module docstring).

    Arguments:
        a: symmetric matrices (symmetrised first, `(A + A^T) / 2`, as `jnp.linalg.eigh` does).
        p: the root; Shampoo uses 4 per side of a matrix (the exponent -1/(2k) for a k-dimensional tensor).
        eps: the damping relative to the largest eigenvalue; well above float32 epsilon (1.2e-7), or the
            smallest eigenvalues are rounding noise (the module docstring's error bound).
    """
    eigenvalues, eigenvectors = _eigh(jnp.asarray(a, jnp.float32))
    w_max = jnp.max(eigenvalues, axis=-1, keepdims=True)
    scale = (jnp.maximum(eigenvalues, 0.0) + eps * w_max) ** (-1.0 / p)
    root = jnp.einsum("...ij,...j,...kj->...ik", eigenvectors, scale, eigenvectors)
    identity = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=jnp.float32), root.shape)
    return jnp.where(w_max[..., None] > 0, root, identity)


def _eigh(a: Float[Array, "*batch n n"]) -> tuple[Float[Array, "*batch n"], Float[Array, "*batch n n"]]:
    """`jnp.linalg.eigh`; on CPU one matrix at a time (`lax.map`): with jax 0.10.2, a batched eigh in a program
    that also runs collectives on several CPU devices (a data-parallel step) can hang, its batch's tasks waiting
    for the thread pool that the other devices' collectives hold (seen with 2 devices on 2 cores; fine in 0.12)."""
    if jax.default_backend() != "cpu":
        return jnp.linalg.eigh(a)
    eigenvalues, eigenvectors = jax.lax.map(jnp.linalg.eigh, a.reshape(-1, *a.shape[-2:]))
    return eigenvalues.reshape(a.shape[:-1]), eigenvectors.reshape(a.shape)


def inverse_pth_roots(
    matrices: Sequence[Array], p: int, eps: ArrayLike = 1e-5, axis_name: Hashable = None
) -> list[Array]:
    """`inverse_pth_root` of every matrix of every array in `matrices` (each `(*batch, n, n)`, n differing from
    array to array), in one batched `eigh` per matrix size.

    With `axis_name` (inside `jax.shard_map`, where `matrices` are the same on every device of that axis, as a
    data-parallel optimizer's state is), the roots are shared out: of the matrices of one size, numbered in
    order, device d computes numbers d, d + n, d + 2n, ... (n devices; the last round padded with identities),
    and one `all_gather` of everything every device computed gives each device all of them. Each device then
    does 1/n of the work instead of all of it; the result is the same as without `axis_name`.
    """
    if not matrices:
        return []
    matrices = [jnp.asarray(matrix, jnp.float32) for matrix in matrices]
    sizes = sorted({matrix.shape[-1] for matrix in matrices})
    groups = {
        size: jnp.concatenate([matrix.reshape(-1, size, size) for matrix in matrices if matrix.shape[-1] == size])
        for size in sizes
    }
    if axis_name is None:
        roots = {size: inverse_pth_root(stack, p, eps) for size, stack in groups.items()}
    else:
        roots = _shared_out(groups, p, eps, axis_name)
    out, taken = [], dict.fromkeys(sizes, 0)
    for matrix in matrices:
        size, count = matrix.shape[-1], matrix[..., 0, 0].size
        out.append(roots[size][taken[size] : taken[size] + count].reshape(matrix.shape))
        taken[size] += count
    return out


def _shared_out(
    groups: dict[int, Float[Array, "count n n"]], p: int, eps: ArrayLike, axis_name: Hashable
) -> dict[int, Float[Array, "count n n"]]:
    """Each device's share of every group's roots, then the one all-gather that gives every device all."""
    devices = jax.lax.axis_size(axis_name)
    device = jax.lax.axis_index(axis_name)
    mine, rounds = [], {}
    for size, stack in groups.items():
        rounds[size] = -(-stack.shape[0] // devices)  # matrices per device, rounded up
        padding_shape = (rounds[size] * devices - stack.shape[0], size, size)
        padding = jnp.broadcast_to(jnp.eye(size, dtype=stack.dtype), padding_shape)
        # [r, d]: number r * devices + d
        dealt = jnp.concatenate([stack, padding]).reshape(rounds[size], devices, size, size)
        share = jax.lax.dynamic_index_in_dim(dealt, device, axis=1, keepdims=False)  # (rounds, size, size)
        mine.append(inverse_pth_root(share, p, eps).reshape(-1))
    # Invariant result: every device holds the same gathered values, so the state stays replicated.
    gathered = jax.lax.all_gather(jnp.concatenate(mine), axis_name, to="invarying")  # (devices, total)
    out, offset = {}, 0
    for size, stack in groups.items():
        elements = rounds[size] * size * size
        part = gathered[:, offset : offset + elements].reshape(devices, rounds[size], size, size)
        out[size] = jnp.swapaxes(part, 0, 1).reshape(-1, size, size)[: stack.shape[0]]  # back to r * devices + d
        offset += elements
    return out
