"""What the recurrent cells (`purejax.nn.lstm`, `purejax.nn.gru`) share: their gate params, and running a cell
over a sequence, one direction or both.

    y, final_state = recurrent.scan(cell, x, state, time_major=False, lengths=None, reverse=False)

`cell(x_t, state) -> (y_t, new_state)` is one time step over a batch: `x_t` (batch, features), `state` a dict
of (batch, ...) arrays. `scan` runs it under `lax.scan` (the step is traced and compiled once, whatever the
length) and returns every step's output, stacked on the time axis in the input's layout, and the final state.

- Layout: `x` is (batch, time, features), torch's `batch_first=True`; with `time_major=True` it is (time,
  batch, features), torch's default, and `y` comes back in the same layout. Either way the scan runs over a
  time-major copy, as `lax.scan` steps over the leading axis.
- Lengths: with `lengths` (batch,), row b holds `lengths[b]` real steps followed by padding. At a step past
  its length a row's state is kept and its output is zero, so the final state is the state after the row's
  last real step, and the padded outputs are zeros: what torch gives for a packed sequence
  (`pack_padded_sequence`, then `pad_packed_sequence`). A length must lie in [0, time]; it is a traced
  value, so that cannot be checked here.
- Direction: `reverse=True` runs from the last step to the first, and writes each output at its own time
  position. With `lengths`, a row's padding comes first in that order and is skipped, so the reversed pass
  starts at the row's last real step, as torch's backward direction does on a packed sequence.

`run_step(rule, ...)` and `run(rule, ...)` are a cell module's `step` and `apply`, written once: a cell supplies
its `CellRule` (its name, gates per unit, state names, and its update from x W_ih + b_ih and the state).

`bidirectional(apply, params, x, state)` is torch's `bidirectional=True` as a composition: a sequence `apply`
(`lstm.apply`, `gru.apply`) run forward with `params["forward"]` and backward (`reverse=True`) with
`params["backward"]`, the outputs concatenated on the feature axis, [forward, backward], as torch orders them.
torch's `weight_ih_l0` belongs in "forward" and `weight_ih_l0_reverse` in "backward".

Several layers are a composition too, as torch's `num_layers`: each layer's output is the next one's input
(with `dropout.apply` between them for torch's `dropout=`), and each has its own state:

    for i, layer in enumerate(layers):
        x, finals[i] = lstm.apply(layer, x, states[i])
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from purejax import random as random_lib
from purejax.nn._check import check_keys
from purejax.nn._matmul import matmul_rows

Params = dict[str, Array]
State = dict[str, Array]
Cell = Callable[[Array, State], tuple[Array, State]]


class CellRule(NamedTuple):
    """What makes a cell an LSTM or a GRU: its `name` (for errors), `n_gates` per unit, its `state_names`, and
    `update(params, input_gates, state) -> (h, new_state)`, the step given x W_ih + b_ih."""

    name: str
    n_gates: int
    state_names: tuple[str, ...]
    update: Callable[[Params, Array, State], tuple[Array, State]]


def input_gates(params: Params, x: Float[Array, "*batch d_in"]) -> Float[Array, "*batch gates"]:
    """x W_ih + b_ih: the part of the gates that does not depend on the state (one product for every step)."""
    gates = matmul_rows(x, params["w_ih"])
    return gates + params["b_ih"] if "b_ih" in params else gates


def run_step(
    rule: CellRule, params: Params, x: Float[ArrayLike, "*batch d_in"], state: Mapping[str, ArrayLike]
) -> tuple[Float[Array, "*batch d_model"], State]:
    """One time step of the cell `rule` describes, its inputs checked."""
    x, state = jnp.asarray(x), {name: jnp.asarray(value) for name, value in state.items()}
    check_cell(rule.name, params, rule.n_gates, x, state, rule.state_names)
    return rule.update(params, input_gates(params, x), state)


def run(
    rule: CellRule,
    params: Params,
    x: Float[ArrayLike, "*batch_and_time d_in"],
    state: Mapping[str, ArrayLike],
    *,
    time_major: bool = False,
    lengths: Int[ArrayLike, " batch"] | None = None,
    reverse: bool = False,
) -> tuple[Float[Array, "*batch_and_time d_model"], State]:
    """The cell over a sequence (`scan`), its inputs checked; every step's x W_ih + b_ih in one product."""
    x, state = jnp.asarray(x), {name: jnp.asarray(value) for name, value in state.items()}
    check_cell(rule.name, params, rule.n_gates, x, state, rule.state_names, time_major=time_major)

    def cell(gates_t: Array, state_t: State) -> tuple[Array, State]:
        return rule.update(params, gates_t, state_t)

    gates = input_gates(params, x)
    return scan(cell, gates, state, time_major=time_major, lengths=lengths, reverse=reverse)


def gate_params(
    key: PRNGKeyArray, d_in: int, d_model: int, n_gates: int, *, bias: bool = True, dtype: Any = jnp.float32
) -> Params:
    """{"w_ih": (d_in, n_gates * d_model), "w_hh": (d_model, n_gates * d_model), "b_ih", "b_hh": (n_gates *
    d_model,)}, every entry U(-1/sqrt(d_model), 1/sqrt(d_model)), torch's initialisation of its recurrent
    layers. Each gets its key by name (`purejax.random.named_keys`); the biases are left out with bias=False."""
    for name, size in (("d_in", d_in), ("d_model", d_model)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"recurrent: {name} must be a positive int, got {size!r}")
    shapes = {"w_ih": (d_in, n_gates * d_model), "w_hh": (d_model, n_gates * d_model)}
    if bias:
        shapes |= {"b_ih": (n_gates * d_model,), "b_hh": (n_gates * d_model,)}
    bound = 1 / d_model**0.5
    keys = random_lib.named_keys(key, *shapes)
    return {name: jax.random.uniform(keys[name], shape, dtype, -bound, bound) for name, shape in shapes.items()}


def check_cell(
    layer: str,
    params: Params,
    n_gates: int,
    x: Array,
    state: Any,
    state_names: tuple[str, ...],
    *,
    time_major: bool | None = None,
) -> None:
    """Raise, naming the argument, unless `params` are a cell's with `n_gates` gates, `x` ends in their d_in and
    `state` is a dict of exactly `state_names` of the shape `x` asks for: (*batch, d_model) for one step of x
    (*batch, d_in) when `time_major` is None, else (batch, d_model) for a sequence x in that layout."""
    check_keys(params, layer, required=("w_ih", "w_hh"), optional=("b_ih", "b_hh"))
    d_in, width = params["w_ih"].shape
    d_model = width // n_gates
    if width != n_gates * d_model or params["w_hh"].shape != (d_model, width):
        raise ValueError(
            f"{layer}: params['w_ih'] has shape {params['w_ih'].shape} and params['w_hh'] {params['w_hh'].shape}, "
            f"expected (d_in, {n_gates} * d_model) and (d_model, {n_gates} * d_model)"
        )
    if time_major is None:
        expected = (*x.shape[:-1], d_model)
    elif x.ndim == 3:
        expected = (x.shape[1] if time_major else x.shape[0], d_model)
    else:
        layout = "(time, batch, d_in)" if time_major else "(batch, time, d_in)"
        raise ValueError(f"{layer}: x has shape {x.shape}, expected 3 axes, {layout} (time_major={time_major})")
    if x.ndim == 0 or x.shape[-1] != d_in:
        raise ValueError(f"{layer}: x has shape {x.shape}, but its last axis must be {d_in} (d_in of params['w_ih'])")
    if not isinstance(state, Mapping) or set(state) != set(state_names):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{layer}: state must be a dict with keys {list(state_names)}, got {got}")
    for name in state_names:
        if jnp.shape(state[name]) != expected:
            raise ValueError(
                f"{layer}: state['{name}'] has shape {jnp.shape(state[name])}, expected {expected} (batch, d_model) "
                f"to match x of shape {x.shape} and params['w_hh'] of shape {params['w_hh'].shape}"
            )


def scan(
    cell: Cell,
    x: Float[ArrayLike, "*batch_and_time features"],
    state: dict[str, ArrayLike],
    *,
    time_major: bool = False,
    lengths: Int[ArrayLike, " batch"] | None = None,
    reverse: bool = False,
) -> tuple[Float[Array, "*batch_and_time d_out"], State]:
    """(y, final_state): `cell` run over the time axis of `x` (see the module docstring for the options)."""
    x, state = jnp.asarray(x), {name: jnp.asarray(value) for name, value in state.items()}
    if x.ndim != 3:
        layout = "(time, batch, features)" if time_major else "(batch, time, features)"
        raise ValueError(f"recurrent.scan: x has shape {x.shape}, expected 3 axes, {layout}")
    xs = x if time_major else jnp.swapaxes(x, 0, 1)  # (time, batch, features): lax.scan steps over axis 0
    time, batch = xs.shape[:2]
    for name, leaf in state.items():
        if leaf.ndim < 1 or leaf.shape[0] != batch:
            raise ValueError(
                f"recurrent.scan: state['{name}'] has shape {leaf.shape}, but its leading axis must be the "
                f"batch, {batch}, of x of shape {x.shape} (time_major={time_major})"
            )
    if lengths is None:
        lengths = jnp.full((batch,), time)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"recurrent.scan: lengths must be integers of shape ({batch},), one per row of x of shape {x.shape}, "
            f"got {lengths.dtype} of shape {lengths.shape}"
        )

    def step(state: State, inputs: tuple[Array, Array]) -> tuple[State, Array]:
        x_t, t = inputs
        y_t, new_state = cell(x_t, state)
        live = t < lengths  # (batch,): the rows still inside their sequence

        def keep_past_end(new: Array, old: Array) -> Array:
            return jnp.where(live.reshape(-1, *[1] * (new.ndim - 1)), new, old).astype(old.dtype)

        return jax.tree.map(keep_past_end, new_state, state), keep_past_end(y_t, jnp.zeros_like(y_t))

    final_state, ys = jax.lax.scan(step, state, (xs, jnp.arange(time)), reverse=reverse)
    return (ys if time_major else jnp.swapaxes(ys, 0, 1)), final_state


def bidirectional(
    apply: Callable[..., tuple[Array, State]],
    params: dict[str, Params],
    x: Float[ArrayLike, "*batch_and_time d_in"],
    state: dict[str, dict[str, ArrayLike]],
    *,
    time_major: bool = False,
    lengths: Int[ArrayLike, " batch"] | None = None,
) -> tuple[Float[Array, "*batch_and_time d_out"], dict[str, State]]:
    """(y, final_state): the sequence `apply` run forward with `params["forward"]` and `state["forward"]`, and
    backward with the "backward" ones; `y` is both outputs concatenated on the feature axis, [forward,
    backward], and `final_state` is {"forward": ..., "backward": ...}."""
    check_keys(params, "recurrent.bidirectional", required=("forward", "backward"))
    if not isinstance(state, Mapping) or set(state) != {"forward", "backward"}:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"recurrent.bidirectional: state must be a dict with keys ['forward', 'backward'], got {got}")
    options = {"time_major": time_major, "lengths": lengths}
    y_forward, forward = apply(params["forward"], x, state["forward"], **options)
    y_backward, backward = apply(params["backward"], x, state["backward"], reverse=True, **options)
    return jnp.concatenate([y_forward, y_backward], axis=-1), {"forward": forward, "backward": backward}
