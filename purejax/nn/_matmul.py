"""`x @ w` over the last axis of `x`, written as one 2-D matrix product: the form every layer's matmul takes.

    y = matmul_rows(x, w)    # x (*batch, d_in), w (d_in, d_out) -> y (*batch, d_out); the same values as x @ w

Why not `x @ w` directly: for a 3-D x (batch, seq, d_in), JAX differentiates `x @ w` into a weight gradient
that contracts two axes (batch and seq) of both operands. To turn that into a plain matrix product, XLA:CPU
transposes one operand, and it fuses the transpose into whatever produced it (the GELU derivative, the
residual gradient), which then writes its whole output with a strided store, many times slower than the same
fusion written in order. Folding the leading axes into rows first, (batch * seq, d_in) @ w, makes the weight
gradient one product that contracts the rows of two row-major operands (xᵀ·g), which the matmul kernel takes as
it is. Same maths, same values, and a faster GPT training step on CPU (docs/benchmarks.md, "Where the step's
time goes on XLA:CPU"). The reshapes are free: they are bitcasts of contiguous arrays.
"""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float


def matmul_rows(x: Float[ArrayLike, "*batch d_in"], w: Float[ArrayLike, "d_in d_out"]) -> Float[Array, "*batch d_out"]:
    """x @ w with the leading axes of `x` flattened into the rows of one (rows, d_in) @ (d_in, d_out) product."""
    x = jnp.asarray(x)
    rows = x.reshape(-1, x.shape[-1])
    return (rows @ w).reshape(*x.shape[:-1], w.shape[-1])
