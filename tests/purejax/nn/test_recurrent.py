"""purejax.nn.lstm, purejax.nn.gru and purejax.nn.recurrent against float64 numpy references written as torch
documents its recurrent layers: an explicit loop over time steps, one row at a time, on torch's parameter layout
(`weight_ih` (gates * hidden, input), gates stacked along the rows), which also tests the documented import
(a transpose). Gradients are checked against central finite differences of the references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from purejax.nn import gru, lstm, recurrent
from tests.purejax.nn.finite_differences import gradient as finite_difference_gradient


def sigmoid(a):
    return 1 / (1 + np.exp(-a))


def to_torch(params):
    """Our params in torch's layout and names, float64: `weight_ih = w_ih.T`, the biases as they are."""
    torch = {
        "weight_ih": np.asarray(params["w_ih"], np.float64).T,
        "weight_hh": np.asarray(params["w_hh"], np.float64).T,
    }
    if "b_ih" in params:
        torch |= {"bias_ih": np.asarray(params["b_ih"], np.float64), "bias_hh": np.asarray(params["b_hh"], np.float64)}
    return torch


def lstm_step_reference(torch, x, state):
    """torch.nn.LSTM's equations for one row: gates i, f, g, o stacked along weight_ih's rows."""
    h, c = state["h"], state["c"]
    gates = torch["weight_ih"] @ x + torch["weight_hh"] @ h
    if "bias_ih" in torch:
        gates = gates + torch["bias_ih"] + torch["bias_hh"]
    i, f, g, o = np.split(gates, 4)
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    return {"h": sigmoid(o) * np.tanh(c), "c": c}


def gru_step_reference(torch, x, state):
    """torch.nn.GRU's equations for one row: gates r, z, n; r applied to W_hn h + b_hn."""
    h = state["h"]
    input_gates, hidden_gates = torch["weight_ih"] @ x, torch["weight_hh"] @ h
    if "bias_ih" in torch:
        input_gates, hidden_gates = input_gates + torch["bias_ih"], hidden_gates + torch["bias_hh"]
    (input_r, input_z, input_n), (hidden_r, hidden_z, hidden_n) = np.split(input_gates, 3), np.split(hidden_gates, 3)
    r = sigmoid(input_r + hidden_r)
    z = sigmoid(input_z + hidden_z)
    n = np.tanh(input_n + r * hidden_n)
    return {"h": (1 - z) * n + z * h}


def sequence_reference(step, params, x, state, lengths=None, reverse=False):
    """(y, final_state) for batch-major x: each row stepped over its first `lengths[b]` steps (backwards from
    its last real step with `reverse`), zeros in y past the end, the final state after the last step taken."""
    torch = to_torch(params)
    x = np.asarray(x, np.float64)
    batch, time, _ = x.shape
    d_model = torch["weight_hh"].shape[1]
    y = np.zeros((batch, time, d_model))
    final = {name: np.zeros((batch, d_model)) for name in state}
    for b in range(batch):
        row_state = {name: np.asarray(value[b], np.float64) for name, value in state.items()}
        length = time if lengths is None else lengths[b]
        for t in reversed(range(length)) if reverse else range(length):
            row_state = step(torch, x[b, t], row_state)
            y[b, t] = row_state["h"]
        for name in state:
            final[name][b] = row_state[name]
    return y, final


CELLS = {"lstm": (lstm, lstm_step_reference), "gru": (gru, gru_step_reference)}


def random_inputs(module, d_in, d_model, batch, time, seed=0, bias=True):
    """Params from the module's init, and a random x (batch, time, d_in) and initial state, float32."""
    rng = np.random.default_rng(seed)
    params = module.init(jax.random.key(seed), d_in, d_model, bias=bias)
    x = rng.normal(size=(batch, time, d_in)).astype(np.float32)
    state = {name: rng.normal(size=(batch, d_model)).astype(np.float32) for name in module.STATE_NAMES}
    return params, x, state


@pytest.mark.parametrize("name", CELLS)
@pytest.mark.parametrize(
    "d_in, d_model, batch, time, bias", [(3, 5, 2, 7, True), (1, 1, 1, 1, True), (4, 7, 3, 6, False)]
)
def test_sequence_matches_the_float64_reference(name, d_in, d_model, batch, time, bias):
    module, step_reference = CELLS[name]
    params, x, state = random_inputs(module, d_in, d_model, batch, time, bias=bias)
    y, final = module.apply(params, x, state)
    want_y, want_final = sequence_reference(step_reference, params, x, state)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for key in module.STATE_NAMES:
        np.testing.assert_allclose(final[key], want_final[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CELLS)
def test_step_is_one_step_of_the_sequence_with_any_leading_axes(name):
    module, step_reference = CELLS[name]
    params, x, state = random_inputs(module, 3, 5, 2, 1)
    y, new_state = module.step(params, x[:, 0], state)
    want_y, want_final = sequence_reference(step_reference, params, x, state)
    np.testing.assert_allclose(y, want_y[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state["h"], want_final["h"], rtol=1e-5, atol=1e-6)
    grid = {key: np.broadcast_to(value, (4, 2, 5)) for key, value in state.items()}
    y_grid, _ = module.step(params, np.broadcast_to(x[:, 0], (4, 2, 3)), grid)
    np.testing.assert_allclose(y_grid, np.broadcast_to(y, (4, 2, 5)), rtol=1e-6)


@pytest.mark.parametrize("name", CELLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_lengths_and_reverse_match_the_reference(name, reverse):
    module, step_reference = CELLS[name]
    params, x, state = random_inputs(module, 3, 5, 3, 6, seed=1)
    lengths = np.array([6, 2, 0])
    y, final = module.apply(params, x, state, lengths=lengths, reverse=reverse)
    want_y, want_final = sequence_reference(step_reference, params, x, state, lengths, reverse)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for key in module.STATE_NAMES:
        np.testing.assert_allclose(final[key], want_final[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(final["h"][2], state["h"][2])  # an empty row keeps its initial state


@pytest.mark.parametrize("name", CELLS)
def test_time_major_is_batch_major_transposed(name):
    module, _ = CELLS[name]
    params, x, state = random_inputs(module, 3, 5, 2, 4, seed=2)
    lengths = np.array([4, 3])
    y, final = module.apply(params, x, state, lengths=lengths)
    y_t, final_t = module.apply(params, np.swapaxes(x, 0, 1), state, time_major=True, lengths=lengths)
    np.testing.assert_allclose(np.swapaxes(y_t, 0, 1), y, rtol=1e-6, atol=1e-7)
    for key in module.STATE_NAMES:
        np.testing.assert_allclose(final_t[key], final[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CELLS)
def test_bidirectional_is_forward_and_backward_concatenated(name):
    module, step_reference = CELLS[name]
    forward, x, forward_state = random_inputs(module, 3, 5, 2, 5, seed=3)
    backward, _, backward_state = random_inputs(module, 3, 5, 2, 5, seed=4)
    lengths = np.array([5, 3])
    y, final = recurrent.bidirectional(
        module.apply,
        {"forward": forward, "backward": backward},
        np.swapaxes(x, 0, 1),
        {"forward": forward_state, "backward": backward_state},
        time_major=True,
        lengths=lengths,
    )
    want_forward, final_forward = sequence_reference(step_reference, forward, x, forward_state, lengths)
    want_backward, final_backward = sequence_reference(step_reference, backward, x, backward_state, lengths, True)
    assert y.shape == (5, 2, 10)
    np.testing.assert_allclose(np.swapaxes(y, 0, 1), np.concatenate([want_forward, want_backward], -1), atol=1e-6)
    np.testing.assert_allclose(final["forward"]["h"], final_forward["h"], atol=1e-6)
    np.testing.assert_allclose(final["backward"]["h"], final_backward["h"], atol=1e-6)


def weighted_sum(y, final, weights):
    """A scalar that depends on every output and every final state entry, with fixed random weights."""
    return (y * weights["y"]).sum() + sum((final[key] * weights[key]).sum() for key in final)


@pytest.mark.parametrize("name", CELLS)
@pytest.mark.parametrize("lengths, reverse", [(None, False), (np.array([4, 2]), True)])
def test_gradients_match_finite_differences_of_the_reference(name, lengths, reverse):
    module, step_reference = CELLS[name]
    params, x, state = random_inputs(module, 3, 5, 2, 4, seed=5)
    rng = np.random.default_rng(6)
    weights = {key: rng.normal(size=shape) for key, shape in [("y", (2, 4, 5)), *((k, (2, 5)) for k in state)]}
    inputs = {"params": params, "x": x, "state": state}

    def loss(inputs):
        y, final = module.apply(inputs["params"], inputs["x"], inputs["state"], lengths=lengths, reverse=reverse)
        return weighted_sum(y, final, weights)

    def reference_loss(inputs):
        y, final = sequence_reference(step_reference, inputs["params"], inputs["x"], inputs["state"], lengths, reverse)
        return weighted_sum(y, final, weights)

    grads = jax.jit(jax.grad(loss))(inputs)
    want = finite_difference_gradient(reference_loss, jax.tree.map(lambda a: np.asarray(a, np.float64), inputs))
    jax.tree.map(lambda got, expected: np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5), grads, want)


@pytest.mark.parametrize("name", CELLS)
def test_init_is_torchs_uniform_with_the_documented_shapes(name):
    module, _ = CELLS[name]
    n_gates = module.N_GATES
    params = module.init(jax.random.key(0), 64, 64)
    assert {key: value.shape for key, value in params.items()} == {
        "w_ih": (64, n_gates * 64),
        "w_hh": (64, n_gates * 64),
        "b_ih": (n_gates * 64,),
        "b_hh": (n_gates * 64,),
    }
    bound = 1 / np.sqrt(64)
    weights = np.concatenate([np.ravel(value) for value in params.values()])
    assert np.abs(weights).max() <= bound and np.abs(weights).max() > 0.99 * bound
    np.testing.assert_allclose(weights.std(), bound / np.sqrt(3), rtol=0.02)  # the std of U(-a, a) is a / sqrt(3)
    assert not np.allclose(params["b_ih"], params["b_hh"])  # a key of their own each
    assert set(module.init(jax.random.key(0), 64, 64, bias=False)) == {"w_ih", "w_hh"}
    assert module.init(jax.random.key(0), 64, 64, dtype=jnp.bfloat16)["w_hh"].dtype == jnp.bfloat16
    assert all((value == 0).all() for value in module.init_state(2, 64).values())


def test_bad_arguments_name_the_argument():
    params, x, state = random_inputs(lstm, 3, 5, 2, 4)
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        lstm.init(jax.random.key(0), 3, 0)
    with pytest.raises(ValueError, match="d_in must be a positive int"):
        gru.init(jax.random.key(0), -1, 4)
    with pytest.raises(ValueError, match=r"lstm: x has shape \(2, 4, 2\), but its last axis must be 3"):
        lstm.apply(params, x[..., :2], state)
    with pytest.raises(ValueError, match=r"lstm: x has shape \(4, 3\), expected 3 axes, \(batch, time, d_in\)"):
        lstm.apply(params, x[0], state)
    with pytest.raises(ValueError, match=r"state must be a dict with keys \['h', 'c'\], got \['h'\]"):
        lstm.apply(params, x, {"h": state["h"]})
    with pytest.raises(ValueError, match=r"lstm: state\['c'\] has shape \(2, 4\), expected \(2, 5\)"):
        lstm.apply(params, x, {"h": state["h"], "c": state["c"][:, :4]})
    with pytest.raises(ValueError, match=r"lstm: state\['h'\] has shape \(2, 5\), expected \(4, 5\)"):
        lstm.apply(params, x, state, time_major=True)
    with pytest.raises(ValueError, match=r"gru: state\['h'\] has shape \(2, 5\), expected \(3, 5\)"):
        gru.step(gru.init(jax.random.key(0), 3, 5), x[0, :3], {"h": state["h"]})
    with pytest.raises(ValueError, match=r"recurrent.scan: x has shape \(4, 3\), expected 3 axes"):
        recurrent.scan(lambda x_t, s: (x_t, s), x[0], state)
    with pytest.raises(ValueError, match=r"recurrent.scan: state\['h'\] has shape \(2, 5\), but its leading axis"):
        recurrent.scan(lambda x_t, s: (x_t, s), x, state, time_major=True)
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \(2,\).*got int\d+ of shape \(3,\)"):
        lstm.apply(params, x, state, lengths=np.array([1, 2, 3]))
    with pytest.raises((ValueError, TypeCheckError), match="lengths"):  # the tests' type checker is first here
        lstm.apply(params, x, state, lengths=np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match=r"params\['w_ih'\] has shape \(3, 20\) and params\['w_hh'\] \(5, 20\)"):
        gru.apply(params, x, {"h": state["h"]})  # an LSTM's params given to the GRU
    with pytest.raises(KeyError, match=r"missing keys \['backward'\]"):
        recurrent.bidirectional(lstm.apply, {"forward": params}, x, {"forward": state, "backward": state})
    with pytest.raises(ValueError, match=r"bidirectional: state must be a dict with keys \['forward', 'backward'\]"):
        recurrent.bidirectional(lstm.apply, {"forward": params, "backward": params}, x, {"forward": state})
