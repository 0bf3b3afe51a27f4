"""purejax.nn.conv_transpose against torch's definition of ConvTranspose{1,2,3}d written in float64 numpy as
explicit loops (each input position scatters its kernel contribution onto the output, with a torch-layout
weight (in_channels, out_channels // groups, *kernel_size) mapped by the documented permutation), forward and
gradients; the gradients against central finite differences of that reference along random directions."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import conv, conv_transpose


def numpy_conv_transpose(x, w_torch, stride, padding, output_padding, dilation, groups):
    """torch's ConvTranspose on a channels-last x: for every input position p and kernel tap t,
    y[n, p * stride - padding + t * dilation, g * out_per_group + o] += x[n, p, g * in_per_group + i] * w[i', o, t]
    with i' = g * in_per_group + i, in float64. Scattered into the uncropped output, then `padding` cropped
    from each end; the output_padding positions at the end get whatever lands there."""
    x, w_torch = np.asarray(x, np.float64), np.asarray(w_torch, np.float64)
    rank = w_torch.ndim - 2
    in_sizes, kernel_size = x.shape[1:-1], w_torch.shape[2:]
    in_per_group, out_per_group = x.shape[-1] // groups, w_torch.shape[1]
    full_sizes = [
        (in_sizes[a] - 1) * stride[a] + (kernel_size[a] - 1) * dilation[a] + 1 + output_padding[a] for a in range(rank)
    ]
    full = np.zeros((x.shape[0], *full_sizes, groups * out_per_group))
    for p in itertools.product(*map(range, in_sizes)):
        for t in itertools.product(*map(range, kernel_size)):
            q = tuple(p[a] * stride[a] + t[a] * dilation[a] for a in range(rank))
            for g in range(groups):
                inputs = slice(g * in_per_group, (g + 1) * in_per_group)
                outputs = slice(g * out_per_group, (g + 1) * out_per_group)
                full[(slice(None), *q, outputs)] += x[(slice(None), *p, inputs)] @ w_torch[(inputs, slice(None), *t)]
    out_sizes = [
        (in_sizes[a] - 1) * stride[a] - 2 * padding[a] + dilation[a] * (kernel_size[a] - 1) + output_padding[a] + 1
        for a in range(rank)
    ]
    crop = tuple(slice(padding[a], padding[a] + out_sizes[a]) for a in range(rank))
    return full[(slice(None), *crop, slice(None))]


def from_torch_layout(w_torch):
    """(in, out // groups, *kernel_size) -> (*kernel_size, in, out // groups): permute(2, 3, 0, 1) in 2-D."""
    rank = w_torch.ndim - 2
    return np.transpose(w_torch, (*range(2, 2 + rank), 0, 1))


# (input spatial sizes, in_channels, out_channels, kernel_size, stride, padding, output_padding, dilation, groups)
CASES = {
    "1d_plain": ((5,), 3, 4, (3,), (1,), (0,), (0,), (1,), 1),
    "1d_stride3_pad2_outpad2": ((6,), 2, 3, (4,), (3,), (2,), (2,), (1,), 1),
    "1d_dilation_groups": ((7,), 4, 6, (3,), (2,), (1,), (1,), (2,), 2),
    "1d_pad_beyond_kernel": ((9,), 2, 2, (2,), (3,), (2,), (0,), (1,), 1),  # a negative pad: crops
    "2d_odd": ((5, 4), 3, 2, (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), 1),
    "2d_groups3": ((4, 5), 6, 9, (3, 3), (2, 2), (1, 1), (0, 1), (1, 1), 3),
    "2d_outpad_below_dilation": ((3, 4), 2, 2, (2, 3), (1, 2), (0, 1), (1, 1), (2, 1), 1),
    "3d": ((3, 4, 3), 2, 3, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 0, 0), (1, 1, 2), 1),
    "3d_groups": ((2, 3, 3), 4, 4, (2, 3, 2), (1, 2, 3), (0, 1, 1), (0, 1, 2), (2, 1, 1), 2),
}


def case(name, seed=0):
    in_sizes, in_channels, out_channels, kernel_size, stride, padding, output_padding, dilation, groups = CASES[name]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, *in_sizes, in_channels)).astype(np.float32)
    w_torch = rng.normal(size=(in_channels, out_channels // groups, *kernel_size)).astype(np.float32)
    b = rng.normal(size=out_channels).astype(np.float32)
    kwargs = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation, groups=groups)
    return x, w_torch, b, kwargs


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_torch_definition(name):
    x, w_torch, b, kwargs = case(name)
    params = {"w": from_torch_layout(w_torch), "b": b}
    y = jax.jit(lambda p, x: conv_transpose.apply(p, x, **kwargs))(params, x)
    want = numpy_conv_transpose(x, w_torch, **kwargs) + b.astype(np.float64)
    chex.assert_shape(y, want.shape)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_output_size_is_torchs_formula():
    params = conv_transpose.init(jax.random.key(0), 2, 3, (3, 5, 2), spatial_dims=3)
    x = jnp.ones((4, 7, 6, 2))  # (depth, height, width, channels): no batch axis
    y = conv_transpose.apply(
        params, x, stride=(2, 3, 1), padding=(1, 2, 0), output_padding=(1, 2, 0), dilation=(1, 1, 2)
    )
    # (in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1, per axis
    chex.assert_shape(y, (3 * 2 - 2 + 2 + 1 + 1, 6 * 3 - 4 + 4 + 2 + 1, 5 * 1 - 0 + 2 * 1 + 0 + 1, 3))


@pytest.mark.parametrize("name", ["1d_stride3_pad2_outpad2", "2d_groups3", "3d"])
def test_gradients_match_finite_differences_of_numpy(name):
    x, w_torch, b, kwargs = case(name, seed=1)
    rng = np.random.default_rng(2)
    dy = rng.normal(size=numpy_conv_transpose(x, w_torch, **kwargs).shape)
    params = {"w": from_torch_layout(w_torch), "b": b}

    def loss(p, x):
        return jnp.sum(conv_transpose.apply(p, x, **kwargs) * dy.astype(np.float32))

    grads, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    grad_w_torch = np.moveaxis(np.asarray(grads["w"], np.float64), (-2, -1), (0, 1))  # back to torch's layout
    for _ in range(3):  # random directions: a wrong gradient entry would have to be orthogonal to all of them
        v_x, v_w = rng.normal(size=x.shape), rng.normal(size=w_torch.shape)
        f = lambda x, w: np.sum(numpy_conv_transpose(x, w, **kwargs) * dy)  # noqa: E731
        x64, w64, eps = x.astype(np.float64), w_torch.astype(np.float64), 1e-2
        want = [(f(x64 + eps * v_x, w64) - f(x64 - eps * v_x, w64)) / (2 * eps)]
        want.append((f(x64, w64 + eps * v_w) - f(x64, w64 - eps * v_w)) / (2 * eps))
        got = [np.sum(np.asarray(grad_x, np.float64) * v_x), np.sum(grad_w_torch * v_w)]
        np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(grads["b"], dy.sum(axis=tuple(range(dy.ndim - 1))), rtol=1e-4)


def test_is_the_input_gradient_of_conv():
    """With the same stride, padding and dilation (and the output_padding that restores the input size), the
    transposed convolution is the vector-Jacobian product of conv.apply with respect to its input."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 8, 7, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 3, 5)), jnp.float32)  # conv: (kh, kw, in=3, out=5)
    forward = lambda x: conv.apply({"w": w}, x, stride=2, padding=1)  # noqa: E731
    y, vjp = jax.vjp(forward, x)
    dy = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
    # the transposed layer's in is conv's out: (kh, kw, 5, 3) with the same taps, so swap the channel axes
    got = conv_transpose.apply({"w": jnp.swapaxes(w, -1, -2)}, dy, stride=2, padding=1, output_padding=(1, 0))
    np.testing.assert_allclose(got, vjp(dy)[0], rtol=1e-5, atol=1e-5)


def test_init_shapes():
    key = jax.random.key(0)
    chex.assert_shape(conv_transpose.init(key, 4, 6, 3, spatial_dims=1, groups=2)["w"], (3, 4, 3))
    params = conv_transpose.init(key, 4, 6, (2, 3))
    chex.assert_shape(params["w"], (2, 3, 4, 6))
    chex.assert_trees_all_equal(params["b"], jnp.zeros(6))
    assert set(conv_transpose.init(key, 2, 2, 2, spatial_dims=3, bias=False)) == {"w"}


def test_bad_arguments_are_named():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"groups=2 must be >= 1 and divide both in_channels=4 and out_channels=3"):
        conv_transpose.init(key, 4, 3, 3, groups=2)
    with pytest.raises(ValueError, match="spatial_dims must be 1, 2 or 3"):
        conv_transpose.init(key, 4, 4, 3, spatial_dims=0)
    params = {"w": jnp.ones((3, 4, 2))}  # 1-D: in 4, out_per_group 2
    x = jnp.ones((1, 5, 4))
    with pytest.raises(ValueError, match=r"output_padding \(2,\) must be smaller than either stride \(2,\)"):
        conv_transpose.apply(params, x, stride=2, output_padding=2)
    with pytest.raises(ValueError, match=r"output_padding \(1,\) must be smaller"):
        conv_transpose.apply(params, x, output_padding=1)  # stride 1, dilation 1
    with pytest.raises(ValueError, match="groups=3 must be >= 1 and divide in_channels=4"):
        conv_transpose.apply(params, x, groups=3)
    with pytest.raises(ValueError, match=r"x has shape \(1, 5, 3\), but its axis -1 must be 4"):
        conv_transpose.apply(params, jnp.ones((1, 5, 3)))
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(2,\), but its axis -1 must be 4"):
        conv_transpose.apply({**params, "b": jnp.zeros(2)}, x, groups=2)
    with pytest.raises(ValueError, match=r"padding must be an int or a \(length,\) tuple of ints >= 0"):
        conv_transpose.apply(params, x, padding=-1)
    with pytest.raises(ValueError, match="crops the whole output"):
        conv_transpose.apply(params, x, padding=4)
    with pytest.raises(ValueError, match=r"x must be \(\*batch, length, in_channels\)"):
        conv_transpose.apply(params, jnp.ones(4))
    with pytest.raises(KeyError, match=r"missing keys \['w'\]"):
        conv_transpose.apply({"kernel": params["w"]}, x)
