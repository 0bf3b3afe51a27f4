"""Gated recurrent unit (Cho et al. 2014) with torch's gate order, parameter layout and initialisation, so that
torch's weights copy across with a transpose.

params: {"w_ih": (d_in, 3 * d_model), "w_hh": (d_model, 3 * d_model), "b_ih", "b_hh": (3 * d_model,)}; the
biases are absent with bias=False. The 3 * d_model columns are three gates side by side, in torch's order:
reset r, update z, new n.
state:  {"h": (batch, d_model)}; zeros from `init_state`.

One time step, torch's documented equations (`nn.GRU`):

    r = sigmoid(x W_ir + b_ir + h W_hr + b_hr)
    z = sigmoid(x W_iz + b_iz + h W_hz + b_hz)
    n = tanh(x W_in + b_in + r * (h W_hn + b_hn))
    h' = (1 - z) * n + z * h

and the output is h'. The reset gate multiplies h W_hn + b_hn, after the product (cuDNN's form, which torch
follows), not h before it as in the paper: so b_hn is not the same parameter as b_in, and both biases matter.

`step(params, x, state)` is that step (torch's `nn.GRUCell`); `apply(params, x, state)` runs a whole sequence
(torch's one-layer `nn.GRU`, with `time_major`, `lengths` and `reverse` as in purejax/nn/recurrent.py, which
also composes two directions and several layers). torch's `hidden_size` is `d_model` here (one name per
concept, docs/design.md); its `(output, h_n)` is `(y, {"h": h_n})` without torch's leading layer axis on h_n.

From torch: `weight_ih_l0` is (3 * hidden_size, input_size) with the gates stacked along its rows in the same
order, so

    params = {"w_ih": weight_ih_l0.T, "w_hh": weight_hh_l0.T, "b_ih": bias_ih_l0, "b_hh": bias_hh_l0}

Initialisation is torch's too: every weight and bias U(-1/sqrt(d_model), 1/sqrt(d_model)).

`apply` computes x W_ih for every time step as one matrix product before the scan: only h W_hh has to wait
for the previous step.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from purejax.nn import recurrent
from purejax.nn._matmul import matmul_rows

Params = dict[str, Array]
State = dict[str, Array]
N_GATES = 3
STATE_NAMES = ("h",)


def init(key: PRNGKeyArray, d_in: int, d_model: int, *, bias: bool = True, dtype: Any = jnp.float32) -> Params:
    """Weights and biases U(-1/sqrt(d_model), 1/sqrt(d_model)), torch's initialisation."""
    return recurrent.gate_params(key, d_in, d_model, N_GATES, bias=bias, dtype=dtype)


def init_state(batch: int, d_model: int, *, dtype: Any = jnp.float32) -> State:
    """Zeros for h, torch's default initial state."""
    return {"h": jnp.zeros((batch, d_model), dtype)}


def step(
    params: Params, x: Float[ArrayLike, "*batch d_in"], state: dict[str, ArrayLike]
) -> tuple[Float[Array, "*batch d_model"], State]:
    """(h', {"h": h'}): one time step (the module docstring's equations)."""
    return recurrent.run_step(RULE, params, x, state)


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch_and_time d_in"],
    state: dict[str, ArrayLike],
    *,
    time_major: bool = False,
    lengths: Int[ArrayLike, " batch"] | None = None,
    reverse: bool = False,
) -> tuple[Float[Array, "*batch_and_time d_model"], State]:
    """(y, final_state) over a sequence: `x` is (batch, time, d_in), or (time, batch, d_in) with `time_major`;
    `y` holds h at every step in the same layout. `lengths` and `reverse` as in purejax/nn/recurrent.py."""
    return recurrent.run(RULE, params, x, state, time_major=time_major, lengths=lengths, reverse=reverse)


def _update(
    params: Params, input_gates: Float[Array, "*batch gates"], state: State
) -> tuple[Float[Array, "*batch d_model"], State]:
    """The step given x W_ih + b_ih: r and z from both products, n with r applied to h W_hn + b_hn."""
    hidden_gates = matmul_rows(state["h"], params["w_hh"])
    if "b_hh" in params:
        hidden_gates = hidden_gates + params["b_hh"]
    input_r, input_z, input_n = jnp.split(input_gates, N_GATES, axis=-1)
    hidden_r, hidden_z, hidden_n = jnp.split(hidden_gates, N_GATES, axis=-1)
    r = jax.nn.sigmoid(input_r + hidden_r)
    z = jax.nn.sigmoid(input_z + hidden_z)
    n = jnp.tanh(input_n + r * hidden_n)
    h = (1 - z) * n + z * state["h"]
    return h, {"h": h}


RULE = recurrent.CellRule("gru", N_GATES, STATE_NAMES, _update)
