"""purejax.nn.conv in 1, 2 and 3 spatial dimensions against a float64 numpy convolution written the slow way
(an explicit loop over output positions and kernel taps, torch's definition), forward and gradients; the
gradients against central finite differences of that reference along random directions."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import conv


def same_pads(size: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's SAME rule, written out: output ceil(size / stride), the odd pad goes after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def explicit_pads(padding, in_sizes, kernel_size, stride, dilation):
    if padding == "SAME":
        return [same_pads(*args) for args in zip(in_sizes, kernel_size, stride, dilation)]
    if padding == "VALID":
        return [(0, 0)] * len(in_sizes)
    if isinstance(padding, int):
        return [(padding, padding)] * len(in_sizes)
    return list(padding)


def numpy_conv(x, w, stride, padding, dilation, groups):
    """y[n, q, g * out_per_group + o] = sum over taps t and in-group channels i of
    padded_x[n, q * stride + t * dilation, g * in_per_group + i] * w[t, i, g * out_per_group + o], in float64,
    one output position and tap at a time."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    rank = w.ndim - 2
    kernel_size, (in_per_group, out_channels) = w.shape[:rank], w.shape[rank:]
    pads = explicit_pads(padding, x.shape[1:-1], kernel_size, stride, dilation)
    padded = np.pad(x, [(0, 0), *pads, (0, 0)])
    out_sizes = [(padded.shape[1 + a] - (kernel_size[a] - 1) * dilation[a] - 1) // stride[a] + 1 for a in range(rank)]
    out_per_group = out_channels // groups
    y = np.zeros((x.shape[0], *out_sizes, out_channels))
    for q in itertools.product(*map(range, out_sizes)):
        for t in itertools.product(*map(range, kernel_size)):
            position = tuple(q[a] * stride[a] + t[a] * dilation[a] for a in range(rank))
            for g in range(groups):
                inputs = padded[(slice(None), *position, slice(g * in_per_group, (g + 1) * in_per_group))]
                outputs = slice(g * out_per_group, (g + 1) * out_per_group)
                y[(slice(None), *q, outputs)] += inputs @ w[t][:, outputs]
    return y


# (input spatial sizes, in_channels, out_channels, kernel_size, stride, padding, dilation, groups): odd sizes,
# strides, every padding form, dilation and groups, in each rank.
CASES = {
    "1d_same": ((9,), 3, 4, (3,), (1,), "SAME", (1,), 1),
    "1d_stride2_pad2_dilation2": ((11,), 4, 6, (3,), (2,), 2, (2,), 2),
    "1d_explicit_groups": ((8,), 6, 3, (4,), (3,), ((2, 1),), (1,), 3),
    "1d_valid_k1": ((5,), 2, 3, (1,), (1,), "VALID", (1,), 1),
    "2d_odd_stride": ((7, 6), 3, 4, (3, 2), (2, 1), ((1, 0), (0, 1)), (1, 2), 1),
    "2d_groups_same_stride2": ((9, 7), 4, 6, (3, 3), (2, 2), "SAME", (1, 1), 2),
    "3d_same": ((5, 4, 6), 2, 3, (3, 3, 3), (1, 1, 1), "SAME", (1, 1, 1), 1),
    "3d_stride_pad_dilation_groups": ((7, 5, 6), 4, 4, (3, 2, 3), (2, 1, 3), 1, (2, 1, 1), 2),
    "3d_explicit_valid_mixed": ((6, 7, 5), 3, 2, (2, 3, 1), (1, 2, 2), ((0, 1), (2, 0), (1, 1)), (1, 1, 1), 1),
}


def case(name, seed=0):
    in_sizes, in_channels, out_channels, kernel_size, stride, padding, dilation, groups = CASES[name]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, *in_sizes, in_channels)).astype(np.float32)
    params = {
        "w": rng.normal(size=(*kernel_size, in_channels // groups, out_channels)).astype(np.float32),
        "b": rng.normal(size=out_channels).astype(np.float32),
    }
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return x, params, kwargs


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_numpy_loops(name):
    x, params, kwargs = case(name)
    y = jax.jit(lambda p, x: conv.apply(p, x, **kwargs))(params, x)
    want = numpy_conv(x, params["w"], **kwargs) + params["b"].astype(np.float64)
    chex.assert_shape(y, want.shape)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def directional_derivatives(f, arrays, directions, eps=1e-2):
    """(f(a + eps v) - f(a - eps v)) / (2 eps) for each array a of `arrays` and its direction v: float64
    central differences, exact up to rounding for a function linear in a, as a convolution is in x and in w."""
    result = []
    for i, v in enumerate(directions):
        plus = [a + eps * v if j == i else a for j, a in enumerate(arrays)]
        minus = [a - eps * v if j == i else a for j, a in enumerate(arrays)]
        result.append((f(*plus) - f(*minus)) / (2 * eps))
    return result


@pytest.mark.parametrize("name", ["1d_stride2_pad2_dilation2", "2d_odd_stride", "3d_stride_pad_dilation_groups"])
def test_gradients_match_finite_differences_of_numpy(name):
    x, params, kwargs = case(name, seed=1)
    rng = np.random.default_rng(2)
    dy = rng.normal(size=numpy_conv(x, params["w"], **kwargs).shape)

    def loss(p, x):
        return jnp.sum(conv.apply(p, x, **kwargs) * dy.astype(np.float32))

    grads, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for _ in range(3):  # random directions: a wrong gradient entry would have to be orthogonal to all of them
        directions = [rng.normal(size=x.shape), rng.normal(size=params["w"].shape)]
        want = directional_derivatives(
            lambda x, w: np.sum(numpy_conv(x, w, **kwargs) * dy), [x.astype(np.float64), params["w"]], directions
        )
        got = [np.sum(np.asarray(grad_x, np.float64) * directions[0]), np.sum(grads["w"] * directions[1])]
        np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(grads["b"], dy.sum(axis=tuple(range(dy.ndim - 1))), rtol=1e-4)


# depthwise, with a channel multiplier: the shifted-slices path and XLA's, in 1-D and 3-D
DEPTHWISE = {
    "1d": ((10,), 3, 2, (3,), (2,), 1, (2,)),
    "3d": ((5, 6, 4), 2, 1, (3, 2, 3), (2, 1, 1), "SAME", (1, 2, 1)),
    "3d_multiplier": ((4, 5, 5), 2, 3, (2, 3, 3), (1, 2, 2), ((1, 0), (0, 2), (1, 1)), (1, 1, 1)),
}


@pytest.mark.parametrize("impl", ["shifts", "xla"])
@pytest.mark.parametrize("name", DEPTHWISE)
def test_depthwise_paths_match_numpy_with_gradients(name, impl):
    in_sizes, channels, multiplier, kernel_size, stride, padding, dilation = DEPTHWISE[name]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, *in_sizes, channels)).astype(np.float32)
    w = rng.normal(size=(*kernel_size, 1, channels * multiplier)).astype(np.float32)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=channels)
    apply = jax.jit(lambda w, x: conv.apply({"w": w}, x, depthwise_impl=impl, **kwargs))
    want = numpy_conv(x, w, **kwargs)
    np.testing.assert_allclose(apply(w, x), want, rtol=1e-5, atol=1e-5)
    dy = rng.normal(size=want.shape)
    grad_w, grad_x = jax.grad(lambda w, x: jnp.sum(apply(w, x) * dy.astype(np.float32)), argnums=(0, 1))(w, x)
    directions = [rng.normal(size=x.shape), rng.normal(size=w.shape)]
    want_grads = directional_derivatives(
        lambda x, w: np.sum(numpy_conv(x, w, **kwargs) * dy), [x.astype(np.float64), w], directions
    )
    got = [np.sum(grad_x * directions[0]), np.sum(grad_w * directions[1])]
    np.testing.assert_allclose(got, want_grads, rtol=1e-4)


def test_leading_batch_axes_and_none():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)
    x = rng.normal(size=(2, 3, 7, 2)).astype(np.float32)
    y = conv.apply({"w": w}, x, padding="VALID")
    chex.assert_shape(y, (2, 3, 5, 4))
    np.testing.assert_allclose(y[1, 2], conv.apply({"w": w}, x[1, 2], padding="VALID"), rtol=1e-6)


def test_init_takes_the_rank_from_spatial_dims():
    key = jax.random.key(0)
    chex.assert_shape(conv.init(key, 4, 6, 5, spatial_dims=1)["w"], (5, 4, 6))
    chex.assert_shape(conv.init(key, 4, 6, (3, 1, 2), spatial_dims=3, groups=2)["w"], (3, 1, 2, 2, 6))
    chex.assert_shape(conv.init(key, 4, 6, 3)["w"], (3, 3, 4, 6))  # the default: 2-D
    volume = conv.init(key, 2, 3, 3, spatial_dims=3)
    chex.assert_shape(conv.apply(volume, jnp.ones((1, 4, 5, 6, 2)), stride=2), (1, 2, 3, 3, 3))


def test_bad_arguments_are_named():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="spatial_dims must be 1, 2 or 3, got 4"):
        conv.init(key, 2, 2, 3, spatial_dims=4)
    with pytest.raises(ValueError, match=r"kernel_size must be an int or a \(depth, height, width\) triple"):
        conv.init(key, 2, 2, (3, 3), spatial_dims=3)
    with pytest.raises(ValueError, match=r"groups=2 must be >= 1 and divide both in_channels=3"):
        conv.init(key, 3, 4, 3, spatial_dims=1, groups=2)
    params = {"w": jnp.ones((3, 2, 4))}
    with pytest.raises(ValueError, match=r"x must be \(\*batch, length, in_channels\), got shape \(2,\)"):
        conv.apply(params, jnp.ones(2))
    with pytest.raises(ValueError, match=r"stride must be an int or a \(length,\) tuple"):
        conv.apply(params, jnp.ones((1, 8, 2)), stride=(2, 2))
    with pytest.raises(ValueError, match=r"explicit padding must be \(\(left, right\),\)"):
        conv.apply(params, jnp.ones((1, 8, 2)), padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match=r"x has shape \(1, 8, 3\), but its axis -1 must be 2"):
        conv.apply(params, jnp.ones((1, 8, 3)))
    with pytest.raises(ValueError, match=r"params\['w'\] must be .* with 1, 2 or 3 spatial axes, got shape \(3, 4\)"):
        conv.apply({"w": jnp.ones((3, 4))}, jnp.ones((1, 8, 3)))
    with pytest.raises(ValueError, match="a 3x3x3 kernel with dilation"):
        conv.apply({"w": jnp.ones((3, 3, 3, 2, 2))}, jnp.ones((1, 2, 5, 5, 2)), padding="VALID")
