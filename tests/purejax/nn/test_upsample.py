"""purejax.nn.upsample against numpy float64 loops over output positions that follow
torch.nn.functional.interpolate (align_corners=False) as ATen writes it (UpSample.h: `nearest_idx`,
`area_pixel_compute_source_index`; UpSampleKernel.cpp's bilinear: two source pixels and two weights per axis).
Both layers are linear in x, so their exact gradient is the transpose of the reference's Jacobian, built here by
running the reference on each unit image."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import upsample


def torch_nearest_source(dst, n_in, n_out):
    """ATen's nearest_neighbor_compute_source_index: floorf(dst * scale), scale = (float)n_in / n_out, a
    float32 product, clamped to the last pixel."""
    scale = np.float32(n_in) / np.float32(n_out)
    return min(int(np.floor(np.float32(dst) * scale)), n_in - 1)


def numpy_nearest(x, out_sizes):
    x = np.asarray(x, np.float64)
    spatial_dims = len(out_sizes)
    in_sizes = x.shape[x.ndim - 1 - spatial_dims : -1]
    lead = x.shape[: x.ndim - 1 - spatial_dims]
    y = np.empty(lead + tuple(out_sizes) + x.shape[-1:])
    for out_index in np.ndindex(*out_sizes):
        source = tuple(torch_nearest_source(i, n_in, n_out) for i, n_in, n_out in zip(out_index, in_sizes, out_sizes))
        y[(Ellipsis, *out_index, slice(None))] = x[(Ellipsis, *source, slice(None))]
    return y


def torch_linear_source(dst, n_in, n_out):
    """ATen's area_pixel_compute_source_index (align_corners=False) and the bilinear kernel's neighbours:
    src = max(scale * (dst + 0.5) - 0.5, 0); the pixel below, the next one unless at the end, their weights."""
    source = max(n_in / n_out * (dst + 0.5) - 0.5, 0.0)
    below = int(source)
    above = below + (1 if below < n_in - 1 else 0)
    weight_above = source - below
    return below, above, 1.0 - weight_above, weight_above


def numpy_bilinear(x, out_size):
    x = np.asarray(x, np.float64)
    (in_h, in_w), (out_h, out_w) = x.shape[-3:-1], out_size
    y = np.empty(x.shape[:-3] + (out_h, out_w, x.shape[-1]))
    for r in range(out_h):
        h0, h1, h0_weight, h1_weight = torch_linear_source(r, in_h, out_h)
        for c in range(out_w):
            w0, w1, w0_weight, w1_weight = torch_linear_source(c, in_w, out_w)
            top = w0_weight * x[..., h0, w0, :] + w1_weight * x[..., h0, w1, :]
            bottom = w0_weight * x[..., h1, w0, :] + w1_weight * x[..., h1, w1, :]
            y[..., r, c, :] = h0_weight * top + h1_weight * bottom
    return y


NEAREST_CASES = [  # (input shape, keyword arguments, output spatial size)
    ((2, 3, 4, 2), {"scale_factor": 2}, (6, 8)),
    ((1, 3, 5, 3), {"scale_factor": (3, 2)}, (9, 10)),
    ((2, 3, 4, 1), {"size": (5, 7)}, (5, 7)),  # non-integer ratios
    ((1, 7, 5, 2), {"size": (3, 4)}, (3, 4)),  # shrinking
    ((1, 26, 3, 1), {"size": (22, 3)}, (22, 3)),  # where torch's float32 scale rounds a source down
    ((2, 2, 3, 4, 1), {"scale_factor": 2}, (6, 8)),  # two batch axes
    ((2, 3, 2), {"size": 7, "spatial_dims": 1}, (7,)),  # 1-D
    ((1, 2, 3, 2, 2), {"scale_factor": (2, 1, 3), "spatial_dims": 3}, (4, 3, 6)),  # 3-D
    ((1, 2, 3, 4, 1), {"size": (3, 5, 3), "spatial_dims": 3}, (3, 5, 3)),
]


@pytest.mark.parametrize("shape, kwargs, out_sizes", NEAREST_CASES)
def test_nearest_matches_numpy(shape, kwargs, out_sizes):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    got = jax.jit(lambda x: upsample.nearest(x, **kwargs))(x)
    np.testing.assert_array_equal(got, numpy_nearest(x, out_sizes).astype(np.float32))


def test_nearest_follows_torch_not_jax_image_resize():
    """3 -> 5 pixels: torch reads floor(i * 3/5) = 0 0 1 1 2; jax.image.resize's nearest reads
    floor((i + 0.5) * 3/5) = 0 0 1 2 2 (torch's "nearest-exact")."""
    x = jnp.arange(3.0).reshape(1, 3, 1)
    assert upsample.nearest(x, size=5, spatial_dims=1)[0, :, 0].tolist() == [0, 0, 1, 1, 2]
    assert jax.image.resize(x, (1, 5, 1), "nearest")[0, :, 0].tolist() == [0, 0, 1, 2, 2]
    # float32 rounding in torch's scale: 26 -> 22, output 11 reads pixel 12 where exact arithmetic gives 13
    column = upsample.nearest(jnp.arange(26.0).reshape(1, 26, 1), size=22, spatial_dims=1)[0, :, 0]
    assert column[11] == 12 and 11 * 26 // 22 == 13


BILINEAR_CASES = [  # (input shape, keyword arguments, output size)
    ((2, 3, 4, 2), {"scale_factor": 2}, (6, 8)),
    ((1, 3, 5, 3), {"scale_factor": (3, 2)}, (9, 10)),
    ((2, 3, 4, 1), {"size": (7, 5)}, (7, 5)),  # non-integer ratios
    ((1, 5, 7, 2), {"size": (2, 3)}, (2, 3)),  # shrinking
    ((1, 4, 4, 1), {"size": (4, 4)}, (4, 4)),  # the same size: the identity
    ((2, 2, 3, 3, 1), {"size": (4, 5)}, (4, 5)),  # two batch axes
]


@pytest.mark.parametrize("shape, kwargs, out_size", BILINEAR_CASES)
def test_bilinear_matches_numpy(shape, kwargs, out_size):
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    got = jax.jit(lambda x: upsample.bilinear(x, **kwargs))(x)
    np.testing.assert_allclose(got, numpy_bilinear(x, out_size), rtol=1e-5, atol=1e-6)


def test_bilinear_values_by_hand():
    """[0, 1] doubled: sources at -0.25 (clamped to 0), 0.25, 0.75, 1.25 (past the end: the last pixel)."""
    x = jnp.array([0.0, 1.0]).reshape(1, 1, 2, 1)
    assert upsample.bilinear(x, scale_factor=(1, 2))[0, 0, :, 0].tolist() == [0.0, 0.25, 0.75, 1.0]


def reference_jacobian(reference, shape):
    """d reference(x) / d x as a (outputs, inputs) matrix: the reference is linear, so column j is its value on
    the j-th unit input."""
    size = int(np.prod(shape))
    return np.stack([reference(np.eye(size)[j].reshape(shape)).ravel() for j in range(size)], axis=1)


@pytest.mark.parametrize(
    "layer, kwargs, reference",
    [
        (upsample.nearest, {"size": (5, 7)}, lambda x: numpy_nearest(x, (5, 7))),
        (upsample.nearest, {"size": (2, 3)}, lambda x: numpy_nearest(x, (2, 3))),
        (upsample.bilinear, {"size": (5, 7)}, lambda x: numpy_bilinear(x, (5, 7))),
        (upsample.bilinear, {"scale_factor": 2}, lambda x: numpy_bilinear(x, (6, 8))),
        (upsample.bilinear, {"size": (2, 3)}, lambda x: numpy_bilinear(x, (2, 3))),
    ],
)
def test_gradients_are_the_transposed_reference(layer, kwargs, reference):
    rng = np.random.default_rng(2)
    shape = (1, 3, 4, 2)
    x = rng.normal(size=shape).astype(np.float32)
    jacobian = reference_jacobian(reference, shape)
    cotangent = rng.normal(size=jacobian.shape[0]).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(layer(x, **kwargs).ravel() * cotangent))(x)
    np.testing.assert_allclose(grad.ravel(), jacobian.T @ cotangent, rtol=1e-5, atol=1e-5)


def test_dtypes_and_array_likes():
    x = np.random.default_rng(3).normal(size=(1, 3, 3, 2)).astype(np.float32)
    assert isinstance(upsample.nearest(x, scale_factor=2), jax.Array)  # numpy in, jax out
    assert isinstance(upsample.bilinear(x, scale_factor=2), jax.Array)
    half = upsample.bilinear(jnp.asarray(x, jnp.bfloat16), size=(5, 4))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(np.float32), numpy_bilinear(x, (5, 4)), atol=0.05)
    labels = np.arange(6, dtype=np.int32).reshape(1, 2, 3, 1)  # nearest copies, so any dtype: segmentation labels
    resized = upsample.nearest(labels, size=(3, 5))
    assert resized.dtype == jnp.int32
    np.testing.assert_array_equal(resized, numpy_nearest(labels, (3, 5)).astype(np.int32))


def test_bad_arguments_name_the_argument():
    x = jnp.ones((1, 3, 4, 2))
    for layer in (upsample.nearest, upsample.bilinear):
        with pytest.raises(ValueError, match="pass exactly one of scale_factor and size"):
            layer(x)
        with pytest.raises(ValueError, match="pass exactly one of scale_factor and size"):
            layer(x, scale_factor=2, size=(6, 8))
        with pytest.raises(ValueError, match=r"scale_factor must be a positive int or 2 positive ints.*got 0"):
            layer(x, scale_factor=0)
        with pytest.raises(ValueError, match=r"scale_factor must be .*got \(2, 2, 2\)"):
            layer(x, scale_factor=(2, 2, 2))
        with pytest.raises(ValueError, match=r"size must be .*got \(0, 3\)"):
            layer(x, size=(0, 3))
    with pytest.raises(ValueError, match=r"upsample.nearest: x must be .* with 2 spatial axes, got shape \(4, 2\)"):
        upsample.nearest(jnp.ones((4, 2)), scale_factor=2)
    with pytest.raises(ValueError, match="spatial_dims must be an int >= 1"):
        upsample.nearest(x, scale_factor=2, spatial_dims=0)
    with pytest.raises(TypeError):  # bilinear weights need a floating-point image
        upsample.bilinear(jnp.ones((1, 3, 4, 2), jnp.int32), scale_factor=2)
