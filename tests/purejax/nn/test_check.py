"""purejax.nn._check: the shared trace-time checks behind every layer's "bad input" errors, tested directly
(the layer tests check the messages as users see them): chex's predicates, purejax's ValueError and words."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn._check import check_dim, check_keys, check_rate, check_same_leading_axis, check_shape


def test_check_keys_accepts_required_plus_optional():
    check_keys({"w": 1}, "linear", required=("w",), optional=("b",))
    check_keys({"w": 1, "b": 2}, "linear", required=("w",), optional=("b",))


def test_check_keys_lists_every_missing_and_unexpected_key_at_once():
    with pytest.raises(KeyError) as err:
        check_keys({"kernel": 1, "bias": 2, "b": 3}, "linear", required=("w", "scale"), optional=("b",))
    assert err.value.args[0] == (
        "linear: params have missing keys ['w', 'scale'] and unexpected keys ['kernel', 'bias']; "
        "expected ['w', 'scale'] and optionally ['b']"
    )


def test_check_keys_refuses_a_non_dict():
    with pytest.raises(TypeError, match=r"linear: params must be a dict with keys \['w'\], got list"):
        check_keys([1, 2], "linear", required=("w",))


def test_check_dim_names_layer_argument_both_shapes_and_the_source():
    check_dim("linear", "x", jnp.ones((2, 3)), -1, 3, "w")
    with pytest.raises(ValueError) as err:
        check_dim("linear", "x", jnp.ones((2, 4)), -1, 3, "params['w'] of shape (3, 5)")
    assert (
        str(err.value) == "linear: x has shape (2, 4), but its axis -1 must be 3 to match params['w'] of shape (3, 5)"
    )


@pytest.mark.parametrize("x", [jnp.float32(1.0), np.float32(1.0), 1.0])
def test_check_dim_refuses_scalars_of_any_kind(x):
    with pytest.raises(ValueError, match=r"x has shape \(\), but its axis -1 must be 3"):
        check_dim("linear", "x", x, -1, 3, "w")


def test_check_dim_works_on_tracers_and_numpy_arrays():
    check_dim("linear", "x", np.ones((2, 3)), -1, 3, "w")
    jax.jit(lambda x: check_dim("linear", "x", x, 0, 2, "w") or x)(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"x has shape \(4, 3\), but its axis 0 must be 2"):
        jax.jit(lambda x: check_dim("linear", "x", x, 0, 2, "w") or x)(jnp.ones((4, 3)))


def test_check_dim_on_an_axis_the_array_does_not_have_is_the_same_clear_error():
    # (by hand, shape[axis] raised a bare IndexError here)
    with pytest.raises(ValueError, match=r"^conv: x has shape \(3,\), but its axis -2 must be 3 to match w$"):
        check_dim("conv", "x", jnp.ones(3), -2, 3, "w")


def test_the_chex_message_is_kept_as_the_cause():
    with pytest.raises(ValueError) as err:
        check_dim("linear", "x", jnp.ones((2, 4)), -1, 3, "w")
    assert isinstance(err.value.__cause__, AssertionError) and "[Chex]" in str(err.value.__cause__)


def test_check_shape_takes_sizes_and_named_wildcards():
    check_shape("mobilenet", "x", np.ones((2, 8, 8, 3)), ("batch", "height", "width", 3), "config.in_channels")
    check_shape("batch_norm", "state['mean']", jnp.ones(4), (4,), "params['scale']")
    with pytest.raises(ValueError) as err:
        check_shape("mobilenet", "x", jnp.ones((8, 8, 3)), ("batch", "height", "width", 3), "config.in_channels")
    assert str(err.value) == (
        "mobilenet: x has shape (8, 8, 3), expected (batch, height, width, 3) to match config.in_channels"
    )
    with pytest.raises(ValueError, match=r"state\['var'\] has shape \(5,\), expected \(4,\) to match"):
        check_shape("batch_norm", "state['var']", jnp.ones(5), (4,), "params['scale']")


def test_check_same_leading_axis_returns_it_or_lists_every_leaf():
    assert check_same_leading_axis("stack", {"a": jnp.ones((3, 2)), "b": np.ones(3)}, "params", "hint") == 3
    with pytest.raises(ValueError) as err:
        check_same_leading_axis("stack", {"a": jnp.ones((3, 2)), "b": jnp.ones(4)}, "params", "build it so")
    assert str(err.value) == (
        "stack: every leaf of params needs the same leading layer axis, got a: float32[3,2], b: float32[4]; build it so"
    )
    with pytest.raises(ValueError, match=r"a: float32\[\], b: float32\[3\]"):  # a scalar has no leading axis
        check_same_leading_axis("stack", {"a": jnp.ones(()), "b": jnp.ones(3)}, "params", "hint")
    with pytest.raises(ValueError, match="params holds only scalars, so it has no layer axis"):
        check_same_leading_axis("stack", {"a": jnp.ones(())}, "params", "hint")
    with pytest.raises(ValueError, match="params has no arrays"):
        check_same_leading_axis("stack", {}, "params", "hint")


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.999])
def test_check_rate_accepts_rates_in_0_1(rate):
    check_rate("dropout", rate)


@pytest.mark.parametrize("rate", [1.0, -0.01, float("nan")])
def test_check_rate_refuses_the_rest(rate):
    with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\)"):
        check_rate("dropout", rate)
