"""purejax.nn._matmul.matmul_rows: the values of x @ w, and gradients whose products contract a single axis."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import embedding, linear
from purejax.nn._matmul import matmul_rows


@pytest.mark.parametrize("batch", [(), (5,), (2, 3), (2, 1, 3)])
def test_equals_x_at_w_in_float64(batch):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(*batch, 6)), rng.normal(size=(6, 4))
    y = matmul_rows(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    assert y.shape == (*batch, 4)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)


def contracting_dims(fn, *args) -> list[str]:
    """The contracting dimensions of every dot_general in the program jax.jit(fn) lowers to, as written."""
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", text)


@pytest.mark.parametrize(
    "layer",
    [
        lambda p, x: linear.apply(p, x),
        lambda p, x: embedding.attend({"w": p["w"].T}, x),  # the tied head: x @ table.T
    ],
    ids=["linear", "attend"],
)
def test_weight_gradients_contract_one_axis_so_xla_needs_no_transposed_copy(layer):
    """The point of matmul_rows (see its module): with a 3-D x, `x @ w` would give a weight gradient that
    contracts (batch, seq) of both operands, which XLA:CPU turns into a transposed copy of the incoming
    gradient. Every product of the forward and backward pass must contract exactly one axis of each side."""
    params = {"w": jnp.ones((8, 16))}
    x = jnp.ones((2, 3, 8))

    def loss(params, x):
        return jnp.tanh(layer(params, x)).sum()

    dims = contracting_dims(jax.grad(loss, argnums=(0, 1)), params, x)
    assert len(dims) == 3, dims  # forward, input gradient, weight gradient
    assert all(len(lhs.split(",")) == 1 and len(rhs.split(",")) == 1 for lhs, rhs in dims), dims
    # the control: the plain 3-D form contracts two axes in its weight gradient
    plain = contracting_dims(jax.grad(lambda w, x: jnp.tanh(x @ w).sum()), params["w"], x)
    assert any(len(lhs.split(",")) == 2 for lhs, _ in plain), plain
