"""torchvision's MobileNetV2 weights to and from purejax, without torch: a state dict saved as .safetensors or .npz.

    params, state = mobilenet_torch.load("mobilenet_v2.safetensors", mobilenet.MobileNetConfig())
    logits, _ = mobilenet.apply(params, images, state, config, train=False)   # images (batch, 224, 224, 3)

torchvision pickles its weights (`mobilenet_v2-b0353104.pth`, ImageNet top-1 71.9%); convert once with torch:

    python -c "import torch, numpy as np; sd = torch.load('mobilenet_v2-b0353104.pth', map_location='cpu');
               np.savez('mobilenet_v2.npz', **{k: v.numpy() for k, v in sd.items()})"

The mapping is a table in models/weight_table.py's format, which every converter shares: one row per array
of ours, with the torch name, our dotted path in `{"params": params, "state": state}`, and the transform.
torchvision's module tree is a `features` Sequential (index 0 the stem, 1..17 the inverted residual blocks,
18 the last 1x1 conv) and a `classifier` (Dropout, Linear). Each conv -> BN pair of ours (a "unit", see
models/mobilenet.py) sits at a pair of module paths (`STEM_UNIT`, `BLOCK_UNITS`, `LAST_UNIT`); every unit
maps its tensors by `UNIT_TENSORS`, and `table` lays the rows out for a config. Layouts differ only in two
ways: conv kernels are OIHW in torch and HWIO here (`CONV`; a depthwise (C, 1, 3, 3) kernel becomes
(3, 3, 1, C), which is purejax.nn.conv's depthwise layout), and Linear weights are (out, in) in torch and
(in, out) here (`LINEAR`). BatchNorm's weight and bias are params; its running_mean and running_var are
state; num_batches_tracked is ignored (it only matters for momentum=None). torchvision's convs pad 3x3
kernels by 1 on every side, which is what models/mobilenet.py does too.

Any mismatch is reported all at once: every missing, unexpected and shape-mismatched tensor by its torch name.
"""

import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import mobilenet, weight_table
from models.weight_table import CONV, LINEAR, SAME, Row
from purejax import safetensors
from purejax import tree as tree_lib

# Where each of our units sits in torchvision's module tree: (our path, torch conv module, torch BN module).
# "{f}" is the block's index in `features` (our block_{f-1}); the expand conv is absent when t == 1, which
# shifts the indices of the others.
STEM_UNIT = ("stem", "features.0.0", "features.0.1")
BLOCK_UNITS = {
    "expanded": (
        ("expand", "features.{f}.conv.0.0", "features.{f}.conv.0.1"),
        ("depthwise", "features.{f}.conv.1.0", "features.{f}.conv.1.1"),
        ("project", "features.{f}.conv.2", "features.{f}.conv.3"),
    ),
    "t=1": (
        ("depthwise", "features.{f}.conv.0.0", "features.{f}.conv.0.1"),
        ("project", "features.{f}.conv.1", "features.{f}.conv.2"),
    ),
}
LAST_UNIT = ("last", "features.{f}.0", "features.{f}.1")  # f = number of blocks + 1
CLASSIFIER: tuple[Row, ...] = (
    (("classifier.1.weight",), "params.classifier.w", LINEAR),
    (("classifier.1.bias",), "params.classifier.b", SAME),
)

# The rows of one unit: (torch name, our path under "params" or "state", transform).
UNIT_TENSORS = (
    ("{conv}.weight", "params.{unit}.conv.w", CONV),
    ("{bn}.weight", "params.{unit}.bn.scale", SAME),
    ("{bn}.bias", "params.{unit}.bn.bias", SAME),
    ("{bn}.running_mean", "state.{unit}.bn.mean", SAME),
    ("{bn}.running_var", "state.{unit}.bn.var", SAME),
)
IGNORED_SUFFIX = ".num_batches_tracked"


def table(config: mobilenet.MobileNetConfig) -> tuple[Row, ...]:
    """Every tensor of torchvision's MobileNetV2 for `config`: (torch names, our path, transform)."""
    if config.version != "v2":
        raise ValueError(f"torchvision has no MobileNet{config.version.upper()}; only version='v2' can be imported")
    units = [STEM_UNIT]
    blocks = config.blocks()
    for f, block in enumerate(blocks, start=1):
        for unit, conv, bn in BLOCK_UNITS["t=1" if block.expand == 1 else "expanded"]:
            units.append((f"{block.name}.{unit}", conv.format(f=f), bn.format(f=f)))
    units.append((LAST_UNIT[0], LAST_UNIT[1].format(f=len(blocks) + 1), LAST_UNIT[2].format(f=len(blocks) + 1)))
    rows = tuple(
        ((name.format(conv=conv, bn=bn),), path.format(unit=unit), transform)
        for unit, conv, bn in units
        for name, path, transform in UNIT_TENSORS
    )
    return rows + CLASSIFIER


def _shapes(config: mobilenet.MobileNetConfig) -> dict[str, Any]:
    """Our params and state for `config` as ShapeDtypeStructs, in the tree the table's paths name."""
    return {
        "params": jax.eval_shape(lambda: mobilenet.init(jax.random.key(0), config)),
        "state": jax.eval_shape(partial(mobilenet.init_state, config)),
    }


def expected_shapes(config: mobilenet.MobileNetConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every tensor a torchvision state dict for `config` must hold, by torch name, in torch's layout."""
    # n_layer=0: no row names a `{i}`, since torchvision numbers every block's module on its own
    return weight_table.expected_shapes(table(config), _shapes(config), config, n_layer=0)


def from_torchvision(
    tensors: Mapping[str, Any],
    config: mobilenet.MobileNetConfig,
    *,
    dtype: Any = jnp.float32,
    source: str = "the tensors",
) -> tuple[mobilenet.Params, mobilenet.State]:
    """(params, state) from a torchvision MobileNetV2 state dict ({name: array}; a `module.` prefix from
    DataParallel is dropped). Params are cast to `dtype`, BatchNorm statistics stay float32. Raises
    TreeMismatchError naming every missing, unexpected and shape-mismatched tensor."""
    tensors = {name.removeprefix("module."): value for name, value in tensors.items()}
    tensors = {name: value for name, value in tensors.items() if not name.endswith(IGNORED_SUFFIX)}
    what = (
        f"{source} (torchvision MobileNetV2 with width_mult={config.width_mult}, n_classes={config.n_classes}, "
        f"in_channels={config.in_channels})"
    )
    tree_lib.assert_like(tensors, expected_shapes(config), what, check_dtype=False)

    def convert(path: str, x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, dtype if path.startswith("params.") else jnp.float32)

    ours = weight_table.from_tensors(table(config), tensors, config, n_layer=0, convert=convert)
    return ours["params"], ours["state"]


def to_torchvision(
    params: mobilenet.Params, state: mobilenet.State, config: mobilenet.MobileNetConfig
) -> dict[str, np.ndarray]:
    """torchvision's MobileNetV2 state dict from ours: the inverse of `from_torchvision` (no num_batches_tracked,
    which torch's `load_state_dict` fills in when absent)."""
    ours = {"params": params, "state": state}
    tree_lib.assert_like(ours, _shapes(config), "params and state", check_dtype=False)
    flat = {path: np.asarray(x) for path, x in tree_lib.flatten(ours).items()}
    return weight_table.to_tensors(table(config), flat, config, n_layer=0)


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A state dict saved as .safetensors (read with purejax.safetensors) or .npz (numpy); no pickle is read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    if path.suffix == ".safetensors":
        return safetensors.load(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    pickled = path.suffix in (".pth", ".pt", ".bin")
    hint = " (torch's pickle format: convert it as this module's docstring shows)" if pickled else ""
    raise ValueError(f"{path}: expected a .safetensors or .npz state dict, got {path.suffix!r}{hint}")


def load(
    path: str | os.PathLike,
    config: mobilenet.MobileNetConfig = mobilenet.MobileNetConfig(),
    *,
    dtype: Any = jnp.float32,
) -> tuple[mobilenet.Params, mobilenet.State]:
    """(params, state) from a torchvision MobileNetV2 state dict file (.safetensors or .npz)."""
    return from_torchvision(read_state_dict(path), config, dtype=dtype, source=str(path))


def save(
    path: str | os.PathLike, params: mobilenet.Params, state: mobilenet.State, config: mobilenet.MobileNetConfig
) -> None:
    """Write torchvision's state dict as .safetensors, for `load` or for torch: `model.load_state_dict({k:
    torch.from_numpy(v) for k, v in safetensors.load(path).items()})` (torch fills in num_batches_tracked)."""
    safetensors.save(path, to_torchvision(params, state, config), metadata={"format": "pt"})
