"""purejax.nn.patch_embedding against a float64 numpy stride-p convolution written as loops (values and, by
central finite differences, gradients), against purejax's own convolution, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.nn import conv, initializers, patch_embedding
from tests.purejax.nn.finite_differences import gradient as finite_differences


def numpy_patch_conv(params, x, p):
    """The stem as the papers write it: a p x p convolution with stride p, kernel = w as (p, p, C, d), every
    output pixel a sum over its own patch, in float64."""
    x = np.asarray(x, np.float64)
    batch, height, width, channels = x.shape
    kernel = np.asarray(params["w"], np.float64).reshape(p, p, channels, -1)
    rows, cols = height // p, width // p
    out = np.zeros((batch, rows, cols, kernel.shape[-1]))
    for i in range(rows):
        for j in range(cols):
            patch = x[:, i * p : (i + 1) * p, j * p : (j + 1) * p, :]
            out[:, i, j] = np.einsum("bhwc,hwcd->bd", patch, kernel)
    out = out + np.asarray(params.get("b", 0.0), np.float64)
    return out.reshape(batch, rows * cols, -1)  # tokens row-major over the grid


def make(in_channels, d_model, p, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    params = patch_embedding.init(jax.random.key(seed), in_channels, d_model, p, bias=bias)
    if bias:  # a non-zero bias, so one added in the wrong place cannot hide
        params["b"] = jnp.asarray(rng.normal(size=d_model), jnp.float32)
    return params, rng


@pytest.mark.parametrize(
    "shape, p, d_model, bias",
    [((2, 6, 9, 5), 3, 7, True), ((1, 4, 4, 3), 2, 8, False), ((3, 5, 10, 1), 5, 4, True), ((2, 3, 3, 2), 1, 3, True)],
)
def test_matches_the_numpy_convolution(shape, p, d_model, bias):
    params, rng = make(shape[-1], d_model, p, bias=bias)
    x = rng.normal(size=shape).astype(np.float32)
    tokens = patch_embedding.apply(params, x, patch_size=p)
    assert tokens.shape == (shape[0], (shape[1] // p) * (shape[2] // p), d_model)
    np.testing.assert_allclose(tokens, numpy_patch_conv(params, x, p), rtol=1e-5, atol=1e-5)


def test_equals_purejax_convolution_with_the_kernel_reshaped():
    params, rng = make(3, 6, 4)
    x = rng.normal(size=(2, 8, 12, 3)).astype(np.float32)
    kernel = {"w": params["w"].reshape(4, 4, 3, 6), "b": params["b"]}  # HWIO
    image = conv.apply(kernel, x, stride=4, padding="VALID")  # (2, 2, 3, 6)
    tokens = patch_embedding.apply(params, x, patch_size=4)
    np.testing.assert_allclose(tokens, image.reshape(2, 6, 6), rtol=1e-5, atol=1e-5)


def test_gradients_match_finite_differences_of_the_numpy_convolution():
    p = 2
    params, rng = make(3, 5, p)
    x = rng.normal(size=(2, 4, 6, 3)).astype(np.float32)
    weights = rng.normal(size=(2, 6, 5))  # a loss whose gradient differs at every output

    def loss(params, x):
        return jnp.sum(jnp.sin(patch_embedding.apply(params, x, patch_size=p)) * weights)

    grads = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))
    inputs = {"w": params["w"], "b": params["b"], "x": x}

    def numpy_loss(values):
        out = numpy_patch_conv({"w": values["w"], "b": values["b"]}, values["x"], p)
        return np.sum(np.sin(out) * weights)

    got = {"w": grads[0]["w"], "b": grads[0]["b"], "x": grads[1]}
    for name, want in finite_differences(numpy_loss, inputs).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_init_is_a_linear_over_the_flattened_patch():
    key = jax.random.key(3)
    params = patch_embedding.init(key, 3, 16, 4, w_init=initializers.xavier_uniform())
    assert params["w"].shape == (4 * 4 * 3, 16) and params["b"].shape == (16,)
    np.testing.assert_array_equal(params["w"], initializers.xavier_uniform()(key, (48, 16), jnp.float32))
    assert set(patch_embedding.init(key, 3, 16, 4, bias=False)) == {"w"}


def test_numpy_input_gives_a_jax_array():
    params, rng = make(2, 3, 2)
    x = rng.normal(size=(1, 4, 4, 2)).astype(np.float32)
    assert isinstance(patch_embedding.apply(params, x, patch_size=2), jax.Array)


def test_errors_name_the_sizes():
    params, _ = make(3, 8, 4)
    with pytest.raises(ValueError, match=r"height=10 and width=12 .* multiples of patch_size=4"):
        patch_embedding.apply(params, jnp.ones((1, 10, 12, 3)), patch_size=4)
    with pytest.raises(ValueError, match=r"height=8 and width=6 .* multiples of patch_size=4"):
        patch_embedding.apply(params, jnp.ones((1, 8, 6, 3)), patch_size=4)
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(48, 8\), but patch_size=2 .* need 12 rows"):
        patch_embedding.apply(params, jnp.ones((1, 8, 8, 3)), patch_size=2)
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(48, 8\), .* \(4 channels\) need 64 rows"):
        patch_embedding.apply(params, jnp.ones((1, 8, 8, 4)), patch_size=4)
    with pytest.raises(ValueError, match="patch_size must be a positive int, got 0"):
        patch_embedding.patchify(jnp.ones((1, 8, 8, 3)), 0)
    with pytest.raises(KeyError, match="patch_embedding: params have missing keys"):
        patch_embedding.apply({"b": params["b"]}, jnp.ones((1, 8, 8, 3)), patch_size=4)
    for name, sizes in (("in_channels", (0, 8, 4)), ("d_model", (3, 0, 4)), ("patch_size", (3, 8, 0))):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            patch_embedding.init(jax.random.key(0), *sizes)
