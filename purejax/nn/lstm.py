"""Long short-term memory (Hochreiter & Schmidhuber 1997; the forget gate of Gers et al. 2000) with torch's
gate order, parameter layout and initialisation, so that torch's weights copy across with a transpose.

params: {"w_ih": (d_in, 4 * d_model), "w_hh": (d_model, 4 * d_model), "b_ih", "b_hh": (4 * d_model,)}; the
biases are absent with bias=False. The 4 * d_model columns are four gates side by side, in torch's order:
input i, forget f, cell g, output o.
state:  {"h": (batch, d_model), "c": (batch, d_model)}, the hidden state and the cell state; zeros from
`init_state`.

One time step, torch's documented equations (`nn.LSTM`):

    i = sigmoid(x W_ii + b_ii + h W_hi + b_hi)
    f = sigmoid(x W_if + b_if + h W_hf + b_hf)
    g = tanh(x W_ig + b_ig + h W_hg + b_hg)
    o = sigmoid(x W_io + b_io + h W_ho + b_ho)
    c' = f * c + i * g
    h' = o * tanh(c')

and the output is h'. `step(params, x, state)` is that step (torch's `nn.LSTMCell`); `apply(params, x, state)`
runs a whole sequence (torch's one-layer `nn.LSTM`, with `time_major`, `lengths` and `reverse` as in
purejax/nn/recurrent.py, which also composes two directions and several layers). torch's `hidden_size` is
`d_model` here (one name per concept, docs/design.md); its `(output, (h_n, c_n))` is `(y, {"h": h_n, "c":
c_n})` without torch's leading layer axis on the final states.

From torch: `weight_ih_l0` is (4 * hidden_size, input_size) with the gates stacked along its rows in the same
order, so

    params = {"w_ih": weight_ih_l0.T, "w_hh": weight_hh_l0.T, "b_ih": bias_ih_l0, "b_hh": bias_hh_l0}

(two biases, as torch keeps: only their sum matters, but keeping both makes the import a copy). Initialisation
is torch's too: every weight and bias U(-1/sqrt(d_model), 1/sqrt(d_model)).

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
N_GATES = 4
STATE_NAMES = ("h", "c")


def init(key: PRNGKeyArray, d_in: int, d_model: int, *, bias: bool = True, dtype: Any = jnp.float32) -> Params:
    """Weights and biases U(-1/sqrt(d_model), 1/sqrt(d_model)), torch's initialisation."""
    return recurrent.gate_params(key, d_in, d_model, N_GATES, bias=bias, dtype=dtype)


def init_state(batch: int, d_model: int, *, dtype: Any = jnp.float32) -> State:
    """Zeros for h and c, torch's default initial state."""
    return {name: jnp.zeros((batch, d_model), dtype) for name in STATE_NAMES}


def step(
    params: Params, x: Float[ArrayLike, "*batch d_in"], state: dict[str, ArrayLike]
) -> tuple[Float[Array, "*batch d_model"], State]:
    """(h', {"h": h', "c": c'}): one time step (the module docstring's equations)."""
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
    """The step given x W_ih + b_ih: add h W_hh + b_hh, split into i, f, g, o, update c and h."""
    gates = input_gates + matmul_rows(state["h"], params["w_hh"])
    if "b_hh" in params:
        gates = gates + params["b_hh"]
    i, f, g, o = jnp.split(gates, N_GATES, axis=-1)
    c = jax.nn.sigmoid(f) * state["c"] + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return h, {"h": h, "c": c}


RULE = recurrent.CellRule("lstm", N_GATES, STATE_NAMES, _update)
