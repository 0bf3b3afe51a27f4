"""purejax.nn.group_norm and instance_norm against numpy float64 loops written in torch's layout: each sample
moved to (channels, positions), as torch's `nn.GroupNorm` and `nn.InstanceNorm2d` see it, and normalised group by
group (channel by channel), with the biased variance. Gradients against central finite differences of the same
references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import group_norm, instance_norm
from tests.purejax.nn.finite_differences import gradient as finite_difference_gradient


def to_torch_layout(x, spatial_dims):
    """(*batch, *spatial, channels) -> (samples, channels, positions), torch's (N, C, L) view of the input."""
    channels = x.shape[-1]
    return x.reshape(-1, int(np.prod(x.shape[x.ndim - 1 - spatial_dims : -1])), channels).transpose(0, 2, 1)


def from_torch_layout(y, shape):
    return y.transpose(0, 2, 1).reshape(shape)


def numpy_group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, spatial_dims=2):
    """torch.nn.functional.group_norm, the slow way: for each sample and each group of contiguous channels,
    subtract the mean and divide by sqrt(biased variance + eps) over the group's channels and positions."""
    x = np.asarray(x, np.float64)
    xt = to_torch_layout(x, spatial_dims)
    per_group = xt.shape[1] // num_groups
    yt = np.empty_like(xt)
    for sample in range(xt.shape[0]):
        for group in range(num_groups):
            channels = slice(group * per_group, (group + 1) * per_group)
            block = xt[sample, channels]
            mean = block.sum() / block.size
            var = ((block - mean) ** 2).sum() / block.size
            yt[sample, channels] = (block - mean) / np.sqrt(var + eps)
    if weight is not None:
        yt = yt * np.asarray(weight, np.float64)[None, :, None] + np.asarray(bias, np.float64)[None, :, None]
    return from_torch_layout(yt, x.shape)


def numpy_instance_norm(x, weight=None, bias=None, eps=1e-5, spatial_dims=2):
    """torch.nn.functional.instance_norm without running statistics: each (sample, channel) over its positions."""
    x = np.asarray(x, np.float64)
    xt = to_torch_layout(x, spatial_dims)
    yt = np.empty_like(xt)
    for sample in range(xt.shape[0]):
        for channel in range(xt.shape[1]):
            row = xt[sample, channel]
            yt[sample, channel] = (row - row.mean()) / np.sqrt(row.var() + eps)
    if weight is not None:
        yt = yt * np.asarray(weight, np.float64)[None, :, None] + np.asarray(bias, np.float64)[None, :, None]
    return from_torch_layout(yt, x.shape)


def random_params(channels, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "scale": rng.normal(1.0, 0.5, channels).astype(np.float32),
        "bias": rng.normal(0.0, 0.5, channels).astype(np.float32),
    }


CASES = [  # (shape, num_groups, spatial_dims)
    ((2, 5, 7, 6), 3, 2),
    ((2, 3, 4, 4, 8), 2, 2),  # two batch axes
    ((2, 4, 4, 5), 1, 2),  # one group: all channels and positions
    ((3, 9, 4), 4, 1),  # sequences
    ((2, 3, 4, 5, 6), 6, 3),  # volumes, one channel per group
    ((5, 12), 4, 0),  # features: each sample's groups of channels
    ((3, 3, 6), 2, 2),  # one image, no batch axis
]


@pytest.mark.parametrize("shape, num_groups, spatial_dims", CASES)
def test_group_norm_matches_numpy(shape, num_groups, spatial_dims):
    x = (np.random.default_rng(0).normal(size=shape) * 3 + 2).astype(np.float32)  # off-centre, not unit scale
    params = random_params(shape[-1])
    norm = jax.jit(lambda p, x: group_norm.apply(p, x, num_groups=num_groups, spatial_dims=spatial_dims))
    want = numpy_group_norm(x, num_groups, params["scale"], params["bias"], spatial_dims=spatial_dims)
    np.testing.assert_allclose(norm(params, x), want, rtol=1e-5, atol=2e-5)
    plain = group_norm.apply({}, x, num_groups=num_groups, spatial_dims=spatial_dims)
    np.testing.assert_allclose(plain, numpy_group_norm(x, num_groups, spatial_dims=spatial_dims), atol=2e-5)


@pytest.mark.parametrize("shape, num_groups, spatial_dims", [((2, 3, 5, 6), 3, 2), ((2, 5, 4), 2, 1)])
def test_group_norm_gradients_match_finite_differences(shape, num_groups, spatial_dims):
    rng = np.random.default_rng(2)
    x = rng.normal(size=shape).astype(np.float32)
    cotangent = rng.normal(size=shape)
    params = random_params(shape[-1])

    def loss(params, x):
        y = group_norm.apply(params, x, num_groups=num_groups, spatial_dims=spatial_dims)
        return jnp.sum(y * cotangent.astype(np.float32))

    def reference(x, scale, bias):
        return np.sum(numpy_group_norm(x, num_groups, scale, bias, spatial_dims=spatial_dims) * cotangent)

    grad_params, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    scale, bias = params["scale"], params["bias"]
    np.testing.assert_allclose(
        grad_x, finite_difference_gradient(lambda v: reference(v, scale, bias), x), rtol=1e-4, atol=1e-4
    )
    want_scale = finite_difference_gradient(lambda v: reference(x, v, bias), scale)
    np.testing.assert_allclose(grad_params["scale"], want_scale, rtol=1e-4, atol=1e-4)
    want_bias = finite_difference_gradient(lambda v: reference(x, scale, v), bias)
    np.testing.assert_allclose(grad_params["bias"], want_bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, spatial_dims", [((2, 5, 7, 3), 2), ((2, 9, 4), 1), ((1, 3, 4, 5, 2), 3)])
def test_instance_norm_matches_numpy(shape, spatial_dims):
    x = (np.random.default_rng(3).normal(size=shape) * 2 - 1).astype(np.float32)
    params = instance_norm.init(None, shape[-1])
    assert params == {}  # torch's InstanceNorm2d default: affine=False
    got = instance_norm.apply(params, x, spatial_dims=spatial_dims)
    np.testing.assert_allclose(got, numpy_instance_norm(x, spatial_dims=spatial_dims), rtol=1e-5, atol=2e-5)
    affine = random_params(shape[-1])
    got = jax.jit(lambda p, x: instance_norm.apply(p, x, spatial_dims=spatial_dims))(affine, x)
    want = numpy_instance_norm(x, affine["scale"], affine["bias"], spatial_dims=spatial_dims)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_instance_norm_gradient_matches_finite_differences():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3, 4, 3)).astype(np.float32)
    cotangent = rng.normal(size=x.shape)
    grad = jax.grad(lambda x: jnp.sum(instance_norm.apply({}, x) * cotangent.astype(np.float32)))(x)
    want = finite_difference_gradient(lambda v: np.sum(numpy_instance_norm(v) * cotangent), x)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


def test_init_and_dtypes():
    params = group_norm.init(None, 6)
    assert set(params) == {"scale", "bias"} and (params["scale"] == 1).all() and (params["bias"] == 0).all()
    assert group_norm.init(None, 6, affine=False) == {}
    assert set(instance_norm.init(None, 6, affine=True)) == {"scale", "bias"}
    x = np.random.default_rng(5).normal(size=(2, 4, 4, 6)).astype(np.float32)
    y = group_norm.apply(params, x, num_groups=3)
    assert isinstance(y, jax.Array)  # numpy in, jax out
    half = group_norm.apply(params, jnp.asarray(x, jnp.bfloat16), num_groups=3)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(np.float32), y, atol=0.05)


def test_bad_arguments_name_the_argument():
    params, x = group_norm.init(None, 6), jnp.ones((2, 4, 4, 6))
    with pytest.raises(ValueError, match="num_groups must be a positive int that divides the channels.*4"):
        group_norm.apply(params, x, num_groups=4)
    with pytest.raises(ValueError, match="num_groups"):
        group_norm.apply(params, x, num_groups=0)
    with pytest.raises(ValueError, match=r"group_norm: x has shape \(2, 4, 4, 8\).*params\['scale'\]"):
        group_norm.apply(params, jnp.ones((2, 4, 4, 8)), num_groups=2)
    with pytest.raises(ValueError, match="group_norm: x must be .* with 4 spatial axes"):
        group_norm.apply(params, x, num_groups=2, spatial_dims=4)
    with pytest.raises(ValueError, match="spatial_dims must be an int >= 0"):
        group_norm.apply(params, x, num_groups=2, spatial_dims=-1)
    with pytest.raises(KeyError, match=r"missing keys \['bias'\]"):
        group_norm.apply({"scale": params["scale"]}, x, num_groups=2)
    with pytest.raises(ValueError, match="channels must be positive"):
        group_norm.init(None, 0)
    with pytest.raises(ValueError, match=r"instance_norm: x has shape \(2, 4, 4, 8\)"):
        instance_norm.apply(params, jnp.ones((2, 4, 4, 8)))
    with pytest.raises(ValueError, match="instance_norm: x must be"):
        instance_norm.apply({}, jnp.ones((4, 6)))
