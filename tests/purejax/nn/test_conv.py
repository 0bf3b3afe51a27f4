"""purejax.nn.conv against a float64 numpy convolution written as explicit loops over groups and taps, and
against `lax.conv_general_dilated`; the two depthwise paths against each other, gradients included."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import conv, initializers


def same_pads(size: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's SAME rule, written out: output ceil(size / stride), the odd pad goes after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def numpy_conv(x, w, stride, padding, dilation, groups):
    """Direct grouped convolution in float64: for each group and tap, a strided window times the tap matrix."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    (sh, sw), (dh, dw) = stride, dilation
    kh, kw, in_per_group, out_channels = w.shape
    if padding == "SAME":
        padding = (same_pads(x.shape[1], kh, sh, dh), same_pads(x.shape[2], kw, sw, dw))
    elif padding == "VALID":
        padding = ((0, 0), (0, 0))
    elif isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    xp = np.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
    oh = (xp.shape[1] - (kh - 1) * dh - 1) // sh + 1
    ow = (xp.shape[2] - (kw - 1) * dw - 1) // sw + 1
    out_per_group = out_channels // groups
    y = np.zeros((x.shape[0], oh, ow, out_channels))
    for g in range(groups):
        xg = xp[..., g * in_per_group : (g + 1) * in_per_group]
        wg = w[..., g * out_per_group : (g + 1) * out_per_group]
        for i in range(kh):
            for j in range(kw):
                window = xg[:, i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw]
                y[..., g * out_per_group : (g + 1) * out_per_group] += window @ wg[i, j]
    return y


# (height, width, channels, multiplier, kernel, stride, padding, dilation): every padding form, strides 1 and 2
# on odd and even sizes, dilation, non-square kernels and a channel multiplier.
DEPTHWISE_CASES = {
    "3x3_s1_same": (8, 8, 4, 1, (3, 3), (1, 1), "SAME", (1, 1)),
    "3x3_s2_same_even": (8, 8, 4, 1, (3, 3), (2, 2), "SAME", (1, 1)),
    "3x3_s2_same_odd": (9, 7, 3, 1, (3, 3), (2, 2), "SAME", (1, 1)),
    "3x3_s2_torch_pad1": (8, 8, 4, 1, (3, 3), (2, 2), 1, (1, 1)),
    "3x3_s1_valid": (7, 8, 4, 1, (3, 3), (1, 1), "VALID", (1, 1)),
    "3x3_dilation2_same": (9, 9, 4, 1, (3, 3), (1, 1), "SAME", (2, 2)),
    "3x3_s2_dilation2_valid": (11, 10, 2, 1, (3, 3), (2, 2), "VALID", (2, 2)),
    "3x5_explicit_pads": (8, 9, 3, 1, (3, 5), (2, 1), ((0, 2), (1, 0)), (1, 1)),
    "5x5_s1_same": (8, 8, 4, 1, (5, 5), (1, 1), "SAME", (1, 1)),
    "multiplier2_s1": (8, 8, 3, 2, (3, 3), (1, 1), "SAME", (1, 1)),
    "multiplier3_s2_pad1": (9, 8, 2, 3, (3, 3), (2, 2), 1, (1, 1)),
}


def depthwise_case(name: str, seed: int = 0):
    h, w, c, mult, kernel, stride, padding, dilation = DEPTHWISE_CASES[name]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, h, w, c)).astype(np.float32)
    params = {"w": rng.normal(size=(*kernel, 1, c * mult)).astype(np.float32)}
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=c)
    return jnp.asarray(x), jax.tree.map(jnp.asarray, params), kwargs


# Every case under jit; a few also eagerly (op by op), which compiles each primitive separately and is slower.
CASES_AND_MODES = [(name, True) for name in DEPTHWISE_CASES] + [
    (name, False) for name in ("3x3_s2_same_odd", "3x3_dilation2_same", "multiplier3_s2_pad1")
]
CASE_IDS = [f"{name}-{'jit' if jit else 'eager'}" for name, jit in CASES_AND_MODES]


@pytest.mark.parametrize("impl", ["xla", "shifts"])
@pytest.mark.parametrize("name, jit", CASES_AND_MODES, ids=CASE_IDS)
def test_depthwise_matches_numpy_and_lax(name, jit, impl):
    x, params, kwargs = depthwise_case(name)
    f = lambda p, x: conv.apply(p, x, depthwise_impl=impl, **kwargs)  # noqa: E731
    y = (jax.jit(f) if jit else f)(params, x)
    want = numpy_conv(x, params["w"], kwargs["stride"], kwargs["padding"], kwargs["dilation"], kwargs["groups"])
    chex.assert_shape(y, want.shape)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    pads = kwargs["padding"]
    pads = ((pads, pads), (pads, pads)) if isinstance(pads, int) else pads
    lax_y = jax.lax.conv_general_dilated(
        x,
        params["w"],
        kwargs["stride"],
        pads,
        rhs_dilation=kwargs["dilation"],
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=kwargs["groups"],
    )
    np.testing.assert_allclose(y, lax_y, rtol=1e-5, atol=1e-5)


GRADIENT_CASES = ["3x3_s2_same_even", "3x3_s2_dilation2_valid", "3x5_explicit_pads", "multiplier3_s2_pad1"]


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_depthwise_gradients_of_shifts_path_match_xla(name):
    x, params, kwargs = depthwise_case(name, seed=1)
    out_shape = jax.eval_shape(lambda p, x: conv.apply(p, x, **kwargs), params, x).shape
    dy = jnp.asarray(np.random.default_rng(2).normal(size=out_shape), jnp.float32)

    def gradients(impl):
        loss = lambda p, x: jnp.sum(conv.apply(p, x, depthwise_impl=impl, **kwargs) * dy)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    grads = {impl: gradients(impl) for impl in ("xla", "shifts")}
    chex.assert_trees_all_close(grads["shifts"], grads["xla"], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(grads["shifts"][0]["w"]).max()) > 0.1  # a real gradient, not two zeros


@pytest.mark.parametrize(
    "groups, in_channels, out_channels, kernel, stride, padding, dilation",
    [
        (1, 3, 5, (3, 3), (1, 1), "SAME", (1, 1)),
        (1, 4, 6, (1, 1), (1, 1), "VALID", (1, 1)),  # a pointwise (1x1) convolution
        (1, 3, 4, (3, 2), (2, 1), ((1, 0), (0, 1)), (1, 2)),
        (2, 4, 6, (3, 3), (2, 2), "SAME", (1, 1)),
        (3, 6, 3, (2, 2), (1, 1), 1, (1, 1)),
    ],
)
def test_dense_and_grouped_match_numpy(groups, in_channels, out_channels, kernel, stride, padding, dilation):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 7, 8, in_channels)), jnp.float32)
    params = {
        "w": jnp.asarray(rng.normal(size=(*kernel, in_channels // groups, out_channels)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=out_channels), jnp.float32),
    }
    y = conv.apply(params, x, stride=stride, padding=padding, dilation=dilation, groups=groups)
    want = numpy_conv(x, params["w"], stride, padding, dilation, groups) + np.asarray(params["b"], np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_any_number_of_leading_batch_axes(batch):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 3, 1, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(*batch, 6, 6, 3)), jnp.float32)
    apply = jax.jit(lambda p, x: conv.apply(p, x, groups=3))
    y = apply(params, x)
    chex.assert_shape(y, (*batch, 6, 6, 3))
    flat = apply(params, x.reshape(-1, 6, 6, 3))
    np.testing.assert_allclose(y.reshape(flat.shape), flat, rtol=1e-6)


def test_auto_picks_shifts_for_depthwise_on_cpu_and_xla_otherwise(monkeypatch):
    x = jnp.ones((1, 6, 6, 4))
    depthwise, dense = {"w": jnp.ones((3, 3, 1, 4))}, {"w": jnp.ones((3, 3, 4, 4))}

    def uses_xla_conv(params, groups):
        return "conv_general_dilated" in str(jax.make_jaxpr(lambda p, x: conv.apply(p, x, groups=groups))(params, x))

    assert jax.default_backend() == "cpu"
    assert not uses_xla_conv(depthwise, 4)
    assert uses_xla_conv(dense, 1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert uses_xla_conv(depthwise, 4)


def test_bfloat16_both_paths_agree_with_float32():
    x, params, kwargs = depthwise_case("3x3_s2_same_even")
    want = conv.apply(params, x, depthwise_impl="xla", **kwargs)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
    for impl in ("xla", "shifts"):
        y = conv.apply(*bf16, depthwise_impl=impl, **kwargs)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=5e-2, atol=5e-2)


def test_init_shapes_and_he_normal_default():
    params = jax.jit(conv.init, static_argnums=(1, 2, 3))(jax.random.key(0), 64, 256, 3)  # one compile, not one per op
    chex.assert_shape(params["w"], (3, 3, 64, 256))
    chex.assert_trees_all_equal(params["b"], jnp.zeros(256))
    np.testing.assert_allclose(np.std(params["w"]), math.sqrt(2 / (3 * 3 * 64)), rtol=0.03)  # He: 2 / fan_in
    depthwise = conv.init(jax.random.key(0), 8, 16, (3, 5), groups=8, bias=False)
    assert set(depthwise) == {"w"}
    chex.assert_shape(depthwise["w"], (3, 5, 1, 16))
    custom = conv.init(jax.random.key(0), 2, 2, 1, w_init=initializers.zeros(), dtype=jnp.bfloat16)
    assert custom["w"].dtype == custom["b"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------ errors


def test_wrong_channel_count_names_the_argument_and_the_grouping():
    params = {"w": jnp.ones((3, 3, 1, 8))}
    with pytest.raises(ValueError, match=r"conv: x has shape \(1, 5, 5, 4\), but its axis -1 must be 8 .* groups=8"):
        conv.apply(params, jnp.ones((1, 5, 5, 4)), groups=8)
    with pytest.raises(ValueError, match="must be 1 to match params\\['w'\\] of shape \\(3, 3, 1, 8\\) with groups=1"):
        conv.apply(params, jnp.ones((1, 5, 5, 8)))  # forgot groups: a depthwise kernel needs groups=8


def test_bad_params_and_arguments_are_named():
    params = {"w": jnp.ones((3, 3, 4, 4))}
    with pytest.raises(KeyError, match=r"missing keys \['w'\] and unexpected keys \['kernel'\]"):
        conv.apply({"kernel": params["w"]}, jnp.ones((1, 5, 5, 4)))
    with pytest.raises(ValueError, match="padding must be 'SAME', 'VALID'"):
        conv.apply(params, jnp.ones((1, 5, 5, 4)), padding="FULL")
    with pytest.raises(ValueError, match="explicit padding must be"):
        conv.apply(params, jnp.ones((1, 5, 5, 4)), padding=((1, 1),))
    with pytest.raises(ValueError, match="stride must be"):
        conv.apply(params, jnp.ones((1, 5, 5, 4)), stride=0)
    with pytest.raises(ValueError, match="depthwise_impl='shifts' needs a depthwise convolution"):
        conv.apply(params, jnp.ones((1, 5, 5, 4)), depthwise_impl="shifts")
    with pytest.raises(ValueError, match="does not fit"):
        conv.apply(params, jnp.ones((1, 2, 2, 4)), padding="VALID")
    with pytest.raises(ValueError, match="params\\['b'\\] has shape \\(3,\\)"):
        conv.apply({"w": params["w"], "b": jnp.zeros(3)}, jnp.ones((1, 5, 5, 4)))


def test_impossible_init_config():
    with pytest.raises(ValueError, match="groups=3 must be >= 1 and divide both in_channels=4"):
        conv.init(jax.random.key(0), 4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="kernel_size must be"):
        conv.init(jax.random.key(0), 4, 4, (3, 3, 3))


def test_image_without_spatial_axes_fails_at_the_call():
    params = {"w": jnp.ones((3, 3, 4, 4))}
    # the spatial rank comes from the kernel, which no annotation of x can see: conv's own check says it
    with pytest.raises(ValueError, match=r"conv: x must be \(\*batch, height, width, in_channels\)"):
        conv.apply(params, jnp.ones((5, 4)))
    with pytest.raises(
        ValueError, match=r"conv: x must be \(\*batch, height, width, in_channels\), got shape \(5, 4\)"
    ):
        conv._check(params, jnp.ones((5, 4)), 1, "auto")
