"""The gated transformer MLP (GLU variants, Shazeer 2020): SwiGLU by default, as in Llama, PaLM and Mistral.

    y = down(activation(gate(x)) * up(x))          activation = SiLU (x * sigmoid(x)): SwiGLU

params: {"gate": linear (d_in, d_ff), "up": linear (d_in, d_ff), "down": linear (d_ff, d_out)}; the names are
Hugging Face's Llama `gate_proj`, `up_proj`, `down_proj` (Meta's w1, w3, w2). No biases by default (Llama has
none). Three matrices instead of two: at equal parameter count the hidden width is 2/3 of the plain MLP's,
which is why Llama's d_ff is about 8/3 d_model rather than 4 d_model (Shazeer 2020, sec. 2).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), as `purejax.nn.mlp`: with `axis_name`, inside
`shard_map`, each device holds a slice of the hidden units: gate and up column-parallel (the same columns of
both, so each unit's gate meets its own up), down row-parallel (the matching rows; its bias replicated). The
gating product is elementwise, so it needs no communication; the partial outputs are summed with one `psum`
before down's bias. x and the output are replicated over the axis.
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
    bias: bool = False,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    proj_init: initializers.Initializer | None = None,
    dtype: Any = jnp.float32,
) -> Params:
    """gate and up (d_in, d_ff), down (d_ff, d_out), d_out defaulting to d_in. `proj_init` overrides the down
    projection's initializer (the one that writes into a residual stream)."""
    keys = prandom.named_keys(key, "gate", "up", "down")
    d_out = d_in if d_out is None else d_out  # not `d_out or d_in`: d_out=0 must fail, not silently become d_in
    return {
        "gate": linear.init(keys["gate"], d_in, d_ff, bias=bias, w_init=w_init, dtype=dtype),
        "up": linear.init(keys["up"], d_in, d_ff, bias=bias, w_init=w_init, dtype=dtype),
        "down": linear.init(keys["down"], d_ff, d_out, bias=bias, w_init=proj_init or w_init, dtype=dtype),
    }


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch d_in"],
    *,
    activation: Callable[[Array], Array] = activations.silu,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> Float[Array, "*batch d_out"]:
    """down(activation(gate(x)) * up(x)), then dropout at rate `dropout` when a key is given. With
    `axis_name`, the hidden units are split over that mesh axis (see the module docstring); the key must then
    be the same on every device of it, so that the replicated output gets the same mask everywhere."""
    check_keys(params, "gated_mlp", required=("gate", "up", "down"))
    for name in ("gate", "up", "down"):  # checked here too, so that errors name the path, not just "linear"
        check_keys(params[name], f"gated_mlp.{name}", required=("w",), optional=("b",))
    x = jnp.asarray(x)
    gate, up = params["gate"]["w"], params["up"]["w"]
    check_dim("gated_mlp", "x", x, -1, gate.shape[0], f"params['gate']['w'] of shape {tuple(gate.shape)}")
    if up.shape != gate.shape:
        raise ValueError(
            f"gated_mlp: params['up']['w'] has shape {tuple(up.shape)} but params['gate']['w'] {tuple(gate.shape)}; "
            f"each hidden unit needs one gate and one up column (under tensor parallelism: shard both alike)"
        )
    h = activation(linear.apply(params["gate"], x)) * linear.apply(params["up"], x)
    y = linear.apply(params["down"], h, axis_name=axis_name)
    return dropout_lib.apply(y, rate=dropout, key=key)
