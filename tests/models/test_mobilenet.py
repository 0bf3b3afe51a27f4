"""models.mobilenet: layout (channels, strides, the small-image rule, parameter counts against torchvision and
the V1 paper), MobileNetV1 against an independent float64 numpy forward, BatchNorm state in train and eval
mode, data-parallel statistics under vmap against the concatenated batch, both depthwise paths, errors.
MobileNetV2's forward is checked against a numpy torchvision forward in test_mobilenet_torch.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import mobilenet
from purejax import tree as tree_lib

SMALL_V2 = mobilenet.MobileNetConfig(n_classes=10, image_size=8, in_channels=1, width_mult=0.25)
SMALL_V1 = mobilenet.MobileNetConfig(version="v1", n_classes=10, image_size=8, in_channels=1, width_mult=0.25)


def random_tree(like, seed):
    """Random params/state built in numpy (one array per leaf, no jitted draws): variances positive."""
    rng = np.random.default_rng(seed)
    flat = tree_lib.flatten(like)
    out = {}
    for path, leaf in flat.items():
        if path.endswith(".var"):
            out[path] = rng.uniform(0.5, 2.0, leaf.shape)
        elif path.endswith(".scale"):
            out[path] = rng.uniform(0.5, 1.5, leaf.shape)
        elif path.endswith("conv.w"):
            out[path] = rng.normal(size=leaf.shape) * np.sqrt(2 / np.prod(leaf.shape[:3]))
        else:
            out[path] = rng.normal(0, 0.1, leaf.shape)
    return tree_lib.unflatten({p: jnp.asarray(v, jnp.float32) for p, v in out.items()})


def shapes(config):
    params = jax.eval_shape(lambda: mobilenet.init(jax.random.key(0), config))
    return params, jax.eval_shape(lambda: mobilenet.init_state(config))


# ---------------------------------------------------------------- layout


def test_parameter_counts_match_torchvision_and_the_v1_paper():
    assert tree_lib.count(shapes(mobilenet.MobileNetConfig())[0]) == 3_504_872  # torchvision mobilenet_v2()
    assert tree_lib.count(shapes(mobilenet.MobileNetConfig(version="v1"))[0]) == 4_231_976  # paper: 4.2M


@pytest.mark.parametrize(
    "size, downsamples, final, stem_stride, strided_blocks",
    [
        (224, 5, 7, 2, [1, 3, 6, 13]),
        (32, 3, 4, 1, [3, 6, 13]),
        (28, 3, 4, 1, [3, 6, 13]),
        (8, 1, 4, 1, [13]),
        (3, 0, 3, 1, []),
    ],
)
def test_small_images_turn_the_earliest_stride_2_layers_into_stride_1(
    size, downsamples, final, stem_stride, strided_blocks
):
    config = mobilenet.MobileNetConfig(image_size=size)
    assert (config.downsamples, config.final_size, config.stem_stride) == (downsamples, final, stem_stride)
    assert [i for i, b in enumerate(config.blocks()) if b.stride == 2] == strided_blocks
    forced = mobilenet.MobileNetConfig(image_size=size, num_downsamples=5)
    assert forced.stem_stride == 2 and [i for i, b in enumerate(forced.blocks()) if b.stride == 2] == [1, 3, 6, 13]


def test_width_multiplier_rounds_channels_as_torchvision():
    assert [mobilenet.make_divisible(c) for c in (11.2, 8.4, 3, 1280 * 0.5, 24 * 0.35, 160 * 1.4)] == [
        16,
        8,
        8,
        640,
        8,
        224,
    ]
    config = mobilenet.MobileNetConfig(width_mult=0.35)  # torchvision mobilenet_v2(width_mult=0.35)
    assert config.stem_channels == 16 and config.last_channels == 1280
    assert [b.out_channels for b in config.blocks()][::4] == [8, 16, 24, 32, 112]
    assert mobilenet.MobileNetConfig(width_mult=1.4).last_channels == 1792


def test_layer_table_describes_every_layer():
    rows = mobilenet.layer_table(mobilenet.MobileNetConfig())
    assert rows[0] == ("stem", "3x3 conv, BN, ReLU6", (112, 112, 32), 2)
    assert rows[-2] == ("last", "1x1 conv, BN, ReLU6", (7, 7, 1280), 1)
    assert len(rows) == 1 + 17 + 2 and sum("+x" in r[1] for r in rows) == 10  # ten residual blocks


# ---------------------------------------------------------------- MobileNetV1 against numpy


def np_conv(x, w, stride, groups):
    """NHWC x, HWIO w, padding k // 2 on every side, float64."""
    k, _, cpg, o = w.shape
    p = k // 2
    n, h, wd, c = x.shape
    xp = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    oh, ow = (h + 2 * p - k) // stride + 1, (wd + 2 * p - k) // stride + 1
    out = np.zeros((n, oh, ow, groups, o // groups))
    wg = w.reshape(k, k, cpg, groups, o // groups)
    for i in range(k):
        for j in range(k):
            patch = xp[:, i : i + stride * (oh - 1) + 1 : stride, j : j + stride * (ow - 1) + 1 : stride]
            out += np.einsum("nhwgc,cgo->nhwgo", patch.reshape(n, oh, ow, groups, cpg), wg[i, j])
    return out.reshape(n, oh, ow, o)


def np_unit(p, s, x, stride, groups, eps=1e-5):
    y = np_conv(x, np.asarray(p["conv"]["w"], np.float64), stride, groups)
    bn, st = (
        {k: np.asarray(v, np.float64) for k, v in p["bn"].items()},
        {k: np.asarray(v, np.float64) for k, v in s["bn"].items()},
    )
    return np.maximum((y - st["mean"]) / np.sqrt(st["var"] + eps) * bn["scale"] + bn["bias"], 0)  # V1: ReLU


def test_v1_eval_forward_matches_numpy():
    config = SMALL_V1
    like_p, like_s = shapes(config)
    params, state = random_tree(like_p, 0), random_tree(like_s, 1)
    x = np.random.default_rng(2).uniform(0, 1, (2, 8, 8, 1))
    h = np_unit(params["stem"], state["stem"], x, config.stem_stride, 1)
    for b in config.blocks():
        h = np_unit(params[b.name]["depthwise"], state[b.name]["depthwise"], h, b.stride, h.shape[-1])
        h = np_unit(params[b.name]["pointwise"], state[b.name]["pointwise"], h, 1, 1)
    expected = h.mean(axis=(1, 2)) @ np.asarray(params["classifier"]["w"], np.float64) + np.asarray(
        params["classifier"]["b"]
    )
    apply = jax.jit(mobilenet.apply, static_argnums=3, static_argnames="train")
    logits, _ = apply(params, x.astype(np.float32), state, config, train=False)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- state, data parallelism, depthwise paths


@pytest.fixture(scope="module")
def v2():
    """Random params and state, a batch of 8 images, and the jitted train-mode output on the whole batch."""
    like_p, like_s = shapes(SMALL_V2)
    params, state = random_tree(like_p, 4), random_tree(like_s, 5)
    x = np.random.default_rng(3).uniform(0, 1, (8, 8, 8, 1)).astype(np.float32)
    out = jax.jit(lambda p, s, x: mobilenet.apply(p, x, s, SMALL_V2, train=True))(params, state, x)
    return params, state, x, out


def test_train_mode_updates_running_statistics_as_torch(v2):
    params, state, x, (_, new_state) = v2
    # The stem's statistics: torch's update with the batch mean and the *unbiased* batch variance.
    y = np_conv(x.astype(np.float64), np.asarray(params["stem"]["conv"]["w"], np.float64), 1, 1)
    mean, var = y.mean(axis=(0, 1, 2)), y.var(axis=(0, 1, 2), ddof=1)
    old = {k: np.asarray(v) for k, v in state["stem"]["bn"].items()}
    np.testing.assert_allclose(new_state["stem"]["bn"]["mean"], 0.9 * old["mean"] + 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state["stem"]["bn"]["var"], 0.9 * old["var"] + 0.1 * var, rtol=1e-5, atol=1e-6)
    assert tree_lib.diff(new_state, state).ok
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state))]
    assert all(moved)  # every BatchNorm of the network updated its statistics


def test_axis_name_gives_the_statistics_of_the_concatenated_batch(v2):
    params, state, x, one = v2
    sharded = jax.jit(
        jax.vmap(lambda x: mobilenet.apply(params, x, state, SMALL_V2, train=True, axis_name="data"), axis_name="data")
    )(x.reshape(2, 4, 8, 8, 1))
    np.testing.assert_allclose(sharded[0].reshape(8, 10), one[0], rtol=2e-4, atol=2e-5)
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(a[0], b, rtol=2e-4, atol=1e-5)
        np.testing.assert_array_equal(a[0], a[1])  # every shard holds the same statistics


def test_xla_depthwise_path_agrees_with_the_shifts_path(v2):
    params, state, x, (auto, _) = v2  # "auto" is the shifts path on CPU
    assert jax.default_backend() != "cpu" or SMALL_V2.depthwise_impl == "auto"
    config = mobilenet.MobileNetConfig(
        **{**SMALL_V2.__dict__, "depthwise_impl": "xla" if jax.default_backend() == "cpu" else "shifts"}
    )
    other, _ = jax.jit(lambda p, s, x: mobilenet.apply(p, x, s, config, train=True))(params, state, x)
    # float32: the paths sum each window in another order, and BatchNorm in training mode divides by the batch's
    # spread; a logit near zero differed by 1.3e-5 on an Intel Xeon (under 1e-5 on an AMD EPYC)
    np.testing.assert_allclose(other, auto, rtol=1e-4, atol=3e-5)


# ---------------------------------------------------------------- errors


def test_errors_name_what_is_wrong(v2):
    params, state, x, _ = v2
    message = r"mobilenet: x has shape \(2, 8, 8, 3\), expected \(batch, height, width, 1\) to match config.in_channels"
    with pytest.raises(ValueError, match=message):
        mobilenet.apply(params, np.zeros((2, 8, 8, 3), np.float32), state, SMALL_V2, train=False)
    with pytest.raises(KeyError, match="missing keys \\['last'\\]"):
        mobilenet.apply({k: v for k, v in params.items() if k != "last"}, x, state, SMALL_V2, train=False)
    with pytest.raises(KeyError, match="state"):
        mobilenet.apply(params, x, {}, SMALL_V2, train=False)
    for bad, match in [
        ({"version": "v3"}, "version"),
        ({"width_mult": 0.0}, "width_mult"),
        ({"num_downsamples": 6}, "num_downsamples"),
        ({"n_classes": 1}, "n_classes"),
        ({"dropout": 1.0}, "dropout"),
        ({"depthwise_impl": "fft"}, "depthwise_impl"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):  # TypeError: the test-time type checker
            mobilenet.MobileNetConfig(**bad)
