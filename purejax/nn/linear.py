"""Linear layer: y = x @ w + b, with w of shape (d_in, d_out).

params: {"w": (d_in, d_out), "b": (d_out,)}; "b" is absent when bias=False.
The (in, out) layout makes the forward pass a plain matmul and matches Hugging Face's GPT-2 Conv1D; torch's
nn.Linear stores the transpose.

Row-parallel (Megatron-LM): with `axis_name`, inside `shard_map`, w holds this device's rows and x the matching
slice of the input features; the partial products are summed over the axis (`psum`) and only then is the
(replicated) bias added, once. A column-parallel layer needs nothing special: each device holds some columns
of w and b and computes its slice of y.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn import initializers
from purejax.nn._check import check_dim, check_keys
from purejax.nn._matmul import matmul_rows

Params = dict[str, Array]


def init(
    key: PRNGKeyArray,
    d_in: int,
    d_out: int,
    *,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    dtype: Any = jnp.float32,
) -> Params:
    """Weights from `w_init` (default LeCun normal), bias zeros."""
    if d_in <= 0 or d_out <= 0:
        raise ValueError(f"linear.init: d_in and d_out must be positive, got d_in={d_in}, d_out={d_out}")
    params = {"w": w_init(key, (d_in, d_out), dtype)}
    if bias:
        params["b"] = jnp.zeros((d_out,), dtype)
    return params


def apply(
    params: Params, x: Float[ArrayLike, "*batch d_in"], *, axis_name: str | None = None
) -> Float[Array, "*batch d_out"]:
    """x @ w (+ b) over the last axis of `x`; any leading axes are kept. With `axis_name`, row-parallel (see
    the module docstring): the result is summed over that mesh axis before the bias."""
    x = jnp.asarray(x)
    check_keys(params, "linear", required=("w",), optional=("b",))
    check_dim("linear", "x", x, -1, params["w"].shape[0], f"params['w'] of shape {tuple(params['w'].shape)}")
    y = matmul_rows(x, params["w"])  # x @ w, as one 2-D product: see _matmul.py for why
    if axis_name is not None:
        y = jax.lax.psum(y, axis_name)
    if "b" in params:
        y = y + params["b"]
    return y
