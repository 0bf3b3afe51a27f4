"""The transformer MLP: linear up to d_ff, activation, linear back down, dropout.

params: {"fc": linear (d_in, d_ff), "proj": linear (d_ff, d_out)}; the names are nanoGPT's (c_fc, c_proj).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): with `axis_name`, inside `shard_map`, each device holds
a slice of the hidden units: fc column-parallel (its columns of fc.w and fc.b), proj row-parallel (the matching
rows of proj.w; proj.b replicated). The activation is elementwise, so it needs no communication; the partial
outputs are summed with one `psum` before proj's bias. x and the output are replicated over the axis.
"""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import activations, initializers, linear
from purejax.nn import dropout as dropout_lib  # `dropout` is apply's keyword for the rate
from purejax.nn._check import check_dim, check_keys

Params = dict[str, Any]


def init(
    key: PRNGKeyArray,
    d_in: int,
    d_ff: int,
    d_out: int | None = None,
    *,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    proj_init: initializers.Initializer | None = None,
    dtype: Any = jnp.float32,
) -> Params:
    """fc (d_in, d_ff) and proj (d_ff, d_out), d_out defaulting to d_in. `proj_init` overrides the down
    projection's initializer (GPT-2 scales it by 1/sqrt(2 * n_layer))."""
    keys = prandom.named_keys(key, "fc", "proj")
    d_out = d_in if d_out is None else d_out  # not `d_out or d_in`: d_out=0 must fail, not silently become d_in
    return {
        "fc": linear.init(keys["fc"], d_in, d_ff, bias=bias, w_init=w_init, dtype=dtype),
        "proj": linear.init(keys["proj"], d_ff, d_out, bias=bias, w_init=proj_init or w_init, dtype=dtype),
    }


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch d_in"],
    *,
    activation: Callable[[Array], Array] = activations.gelu,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "*batch d_out"]:
    """proj(activation(fc(x))), then dropout at rate `dropout` when a key is given. With `axis_name`, the
    hidden units are split over that mesh axis (see the module docstring); the key must then be the same on
    every device of it, so that the replicated output gets the same mask everywhere."""
    check_keys(params, "mlp", required=("fc", "proj"))
    for name in ("fc", "proj"):  # checked here too, so that errors name the path, not just "linear"
        check_keys(params[name], f"mlp.{name}", required=("w",), optional=("b",))
    x = jnp.asarray(x)
    w = params["fc"]["w"]
    check_dim("mlp", "x", x, -1, w.shape[0], f"params['fc']['w'] of shape {tuple(w.shape)}")
    h = activation(linear.apply(params["fc"], x))
    y = linear.apply(params["proj"], h, axis_name=axis_name)
    return dropout_lib.apply(y, rate=dropout, key=key)
