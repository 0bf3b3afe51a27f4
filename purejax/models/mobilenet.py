"""MobileNetV2 (Sandler et al. 2018, arXiv:1801.04381) and MobileNetV1 (Howard et al. 2017, arXiv:1704.04861)
over NHWC images, with BatchNorm's running statistics as explicit state.

V2, torchvision's layout (shapes for a 224x224 image at width 1.0):
    x (batch, 224, 224, 3)
      -> stem: 3x3 conv, stride 2 -> BN -> ReLU6                                        (batch, 112, 112, 32)
      -> 17 inverted residual blocks, in 7 stages (t, c, n, s) = V2_STAGES:
             [1x1 expand to t*c_in -> BN -> ReLU6]   (absent when t = 1)
             3x3 depthwise, stride s on a stage's first block -> BN -> ReLU6
             1x1 project to c -> BN                  (linear bottleneck: no activation)
             + x when the stride is 1 and c_in == c                                      (batch, 7, 7, 320)
      -> last: 1x1 conv to 1280 -> BN -> ReLU6                                           (batch, 7, 7, 1280)
      -> global average pool -> dropout -> linear                                        logits (batch, classes)
V1: the same stem (ReLU instead of ReLU6, as the paper), 13 depthwise-separable blocks (3x3 depthwise -> BN ->
ReLU -> 1x1 conv -> BN -> ReLU) up to 1024 channels, then pool, dropout and the classifier.

params: {"stem": unit, "block_0": {"expand": unit (V2, t > 1), "depthwise": unit, "project" (V2) or
"pointwise" (V1): unit}, ..., "block_16", "last": unit (V2), "classifier": linear}, each unit being
{"conv": {"w"}, "bn": {"scale", "bias"}} (convs have no bias: BN follows).
state: the same tree holding only the BatchNorm statistics, {"stem": {"bn": {"mean", "var"}}, ...}.

Width multiplier: every channel count c becomes `make_divisible(c * width)`, rounded to a multiple of 8, and the
last conv keeps 1280 channels below width 1 and grows above it (torchvision's rule).

Small images: a 224 image passes five stride-2 layers (the stem and the first block of four stages) and ends
7x7. A small image cannot: `MobileNetConfig.num_downsamples` keeps the most stride-2 layers, up to five, that
leave the final feature map at least 4x4, and turns the *earliest* ones into stride 1 (as CIFAR adaptations
of MobileNetV2 do: downsampling a small image before any features exist throws detail away). So 224 keeps all
five (7x7), 32 and 28 keep three (4x4), 8 keeps one (the 160-channel stage, 8x8 -> 4x4). Set it explicitly to
override the rule, e.g. 5 to run torchvision's exact network on any input.

Padding is symmetric as in torch: `padding=1` for every 3x3 conv, stride 1 or 2 (XLA's "SAME" would pad a
stride-2 conv on an even image only at the bottom and right, which shifts every feature by half a pixel and
breaks imported weights).
"""

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import activations, batch_norm, check_keys, conv, dropout, initializers, linear, pooling

Params = dict[str, Any]
State = dict[str, Any]

# MobileNetV2 stages (t expansion, c channels, n blocks, s stride of the first block): the paper's Table 2.
V2_STAGES: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)  # fmt: skip
# MobileNetV1 depthwise-separable blocks (c channels, s stride): the paper's Table 1.
V1_BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), *[(512, 1)] * 5, (1024, 2), (1024, 1),
)  # fmt: skip
STEM_CHANNELS = 32
LAST_CHANNELS = 1280  # V2's last 1x1 conv
MAX_DOWNSAMPLES = 5  # the stem and four stages: a 224 image ends 7x7
MIN_FINAL_SIZE = 4  # the adapted-stem rule keeps the final feature map at least this big

# torchvision's initialisation: He normal with fan_out for convs, N(0, 0.01) for the classifier, BN 1 and 0.
CONV_INIT = initializers.variance_scaling(2.0, "fan_out", "normal")
CLASSIFIER_INIT = initializers.normal(0.01)


def make_divisible(channels: float, divisor: int = 8) -> int:
    """`channels` rounded to the nearest multiple of `divisor` (at least `divisor`), bumped up one multiple
    if rounding lost more than 10% (torchvision's _make_divisible, from the TensorFlow reference)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


class Block(NamedTuple):
    """One block of the network as `MobileNetConfig.blocks` lays it out."""

    name: str  # its key in params and state: "block_0", "block_1", ...
    in_channels: int
    out_channels: int
    expand: int  # V2's expansion factor t (1: no expand conv); 1 for V1
    stride: int
    out_size: int  # height (= width, for a square input of config.image_size) after the block


@dataclass(frozen=True)
class MobileNetConfig:
    """Static description of a MobileNet; frozen and hashable, so it can be a static argument to jax.jit.

    Arguments:
        version: "v2" (inverted residuals, the default) or "v1" (depthwise-separable blocks).
        num_classes: classifier outputs (1000 for ImageNet).
        image_size: the input height and width the stride plan is made for (see `num_downsamples`).
        in_channels: 3 for RGB, 1 for greyscale.
        width: the width multiplier alpha; channels are rounded to multiples of 8 (`make_divisible`).
        dropout: rate before the classifier, applied when `apply` gets a key (torchvision: 0.2).
        num_downsamples: how many of the five stride-2 layers keep stride 2 (the earliest become stride 1);
            None applies the module docstring's rule for `image_size`.
        depthwise_impl: how the 3x3 depthwise convs run (`purejax.nn.conv`: "auto", "xla" or "shifts").
        bn_momentum, bn_eps: BatchNorm's settings, torch's convention and defaults.
    """

    version: Literal["v1", "v2"] = "v2"
    num_classes: int = 1000
    image_size: int = 224
    in_channels: int = 3
    width: float = 1.0
    dropout: float = 0.2
    num_downsamples: int | None = None
    depthwise_impl: conv.DepthwiseImpl = "auto"
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5

    def __post_init__(self):
        if self.version not in ("v1", "v2"):
            raise ValueError(f"MobileNetConfig: version must be 'v1' or 'v2', got {self.version!r}")
        for name in ("num_classes", "image_size", "in_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MobileNetConfig: {name} must be a positive int, got {value!r}")
        if self.num_classes < 2:
            raise ValueError(f"MobileNetConfig: num_classes must be at least 2, got {self.num_classes}")
        if not self.width > 0:
            raise ValueError(f"MobileNetConfig: width must be positive, got {self.width!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MobileNetConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if self.num_downsamples is not None and not 0 <= self.num_downsamples <= MAX_DOWNSAMPLES:
            raise ValueError(
                f"MobileNetConfig: num_downsamples must be None (the rule) or 0..{MAX_DOWNSAMPLES}, "
                f"got {self.num_downsamples!r}"
            )
        if self.depthwise_impl not in ("auto", "xla", "shifts"):
            raise ValueError(
                f"MobileNetConfig: depthwise_impl must be 'auto', 'xla' or 'shifts', got {self.depthwise_impl!r}"
            )

    @property
    def downsamples(self) -> int:
        """The stride-2 layers kept: `num_downsamples`, or the most (up to 5) leaving the output >= 4x4."""
        if self.num_downsamples is not None:
            return self.num_downsamples
        n, size = 0, self.image_size
        while n < MAX_DOWNSAMPLES and -(-size // 2) >= MIN_FINAL_SIZE:
            n, size = n + 1, -(-size // 2)
        return n

    @property
    def stem_channels(self) -> int:
        return make_divisible(STEM_CHANNELS * self.width)

    @property
    def stem_stride(self) -> int:
        return 2 if self.downsamples == MAX_DOWNSAMPLES else 1

    @property
    def last_channels(self) -> int:
        """Channels into the classifier: V2's last conv (1280, scaled only when width > 1), V1's last block."""
        if self.version == "v1":
            return self.blocks()[-1].out_channels
        return make_divisible(LAST_CHANNELS * max(1.0, self.width))

    def blocks(self) -> tuple[Block, ...]:
        """Every block in order, with its channels, stride and output size."""
        if self.version == "v2":
            plan = [(t, c, s if i == 0 else 1) for t, c, n, s in V2_STAGES for i in range(n)]
        else:
            plan = [(1, c, s) for c, s in V1_BLOCKS]
        # The stride-2 blocks that become stride 1: the earliest, after the stem (see the module docstring).
        demoted = MAX_DOWNSAMPLES - self.downsamples - (self.stem_stride == 1)
        size = -(-self.image_size // self.stem_stride)
        in_channels, out = self.stem_channels, []
        for t, c, stride in plan:
            if stride == 2 and demoted > 0:
                stride, demoted = 1, demoted - 1
            size = -(-size // stride)
            channels = make_divisible(c * self.width)
            out.append(Block(f"block_{len(out)}", in_channels, channels, t, stride, size))
            in_channels = channels
        return tuple(out)

    @property
    def final_size(self) -> int:
        """Height of the feature map that is pooled: 7 for 224, 4 for the small inputs of the rule."""
        return self.blocks()[-1].out_size


# ---------------------------------------------------------------- conv -> BN (-> activation), the one unit


def unit_init(key: PRNGKeyArray, in_channels: int, out_channels: int, kernel: int, groups: int = 1) -> Params:
    """A bias-free conv and the BatchNorm after it: {"conv": {"w"}, "bn": {"scale", "bias"}}."""
    w = conv.init(key, in_channels, out_channels, kernel, groups=groups, bias=False, w_init=CONV_INIT)
    return {"conv": w, "bn": batch_norm.init(None, out_channels)}


def unit_state(out_channels: int) -> State:
    return {"bn": batch_norm.init_state(out_channels)}


def unit_apply(
    params: Params,
    state: State,
    x: Float[Array, "batch height width in_channels"],
    config: MobileNetConfig,
    *,
    stride: int = 1,
    depthwise: bool = False,
    train: bool,
    axis_name: Any = None,
) -> tuple[Float[Array, "batch out_height out_width out_channels"], State]:
    """conv (torch's symmetric padding, kernel // 2) -> BN; the caller applies the activation."""
    kernel = params["conv"]["w"].shape[0]
    groups, impl = (x.shape[-1], config.depthwise_impl) if depthwise else (1, "auto")
    y = conv.apply(params["conv"], x, stride=stride, padding=kernel // 2, groups=groups, depthwise_impl=impl)
    y, bn_state = batch_norm.apply(params["bn"], state["bn"], y, train=train, momentum=config.bn_momentum,
                                   eps=config.bn_eps, axis_name=axis_name)  # fmt: skip
    return y, {"bn": bn_state}


# ---------------------------------------------------------------- blocks


def _block_units(block: Block, version: str) -> dict[str, tuple[int, int, int, int]]:
    """{unit name: (in_channels, out_channels, kernel, groups)} of one block, in the order data flows."""
    if version == "v1":
        c_in, c_out = block.in_channels, block.out_channels
        return {"depthwise": (c_in, c_in, 3, c_in), "pointwise": (c_in, c_out, 1, 1)}
    hidden = block.in_channels * block.expand
    units = {"expand": (block.in_channels, hidden, 1, 1)} if block.expand != 1 else {}
    return {**units, "depthwise": (hidden, hidden, 3, hidden), "project": (hidden, block.out_channels, 1, 1)}


def block_apply(
    params: Params,
    state: State,
    x: Float[Array, "batch height width in_channels"],
    block: Block,
    config: MobileNetConfig,
    *,
    train: bool,
    axis_name: Any = None,
) -> tuple[Float[Array, "batch out_height out_width out_channels"], State]:
    """One V2 inverted residual (expand, depthwise, linear projection, residual) or one V1 separable block."""
    act = activations.relu6 if config.version == "v2" else activations.relu
    h, new_state = x, {}
    for name in _block_units(block, config.version):
        depthwise = name == "depthwise"
        h, new_state[name] = unit_apply(params[name], state[name], h, config, stride=block.stride if depthwise else 1,
                                        depthwise=depthwise, train=train, axis_name=axis_name)  # fmt: skip
        if name != "project":  # the projection is linear: ReLU there would destroy information (paper, sec. 3.2)
            h = act(h)
    if config.version == "v2" and block.stride == 1 and block.in_channels == block.out_channels:
        h = h + x
    return h, new_state


# ---------------------------------------------------------------- the whole network


def init(key: PRNGKeyArray, config: MobileNetConfig) -> Params:
    """Parameters initialised as torchvision does (He fan-out convs, BN ones/zeros, N(0, 0.01) classifier)."""
    blocks = config.blocks()
    names = ("stem", *(b.name for b in blocks), "last", "classifier")
    keys = prandom.named_keys(key, *names)
    params = {"stem": unit_init(keys["stem"], config.in_channels, config.stem_channels, 3)}
    for block in blocks:
        units = _block_units(block, config.version)
        unit_keys = prandom.named_keys(keys[block.name], *units)
        params[block.name] = {name: unit_init(unit_keys[name], *spec) for name, spec in units.items()}
    if config.version == "v2":
        params["last"] = unit_init(keys["last"], blocks[-1].out_channels, config.last_channels, 1)
    params["classifier"] = linear.init(keys["classifier"], config.last_channels, config.num_classes,
                                       w_init=CLASSIFIER_INIT)  # fmt: skip
    return params


def init_state(config: MobileNetConfig) -> State:
    """BatchNorm statistics before training: running means 0 and variances 1, for every unit."""
    state = {"stem": unit_state(config.stem_channels)}
    for block in config.blocks():
        state[block.name] = {name: unit_state(spec[1]) for name, spec in _block_units(block, config.version).items()}
    if config.version == "v2":
        state["last"] = unit_state(config.last_channels)
    return state


def apply(
    params: Params,
    state: State,
    x: Float[ArrayLike, "batch height width in_channels"],
    config: MobileNetConfig,
    *,
    train: bool,
    key: PRNGKeyArray | None = None,
    axis_name: Any = None,
) -> tuple[Float[Array, "batch num_classes"], State]:
    """(logits, new_state) for the NHWC images `x`.

    Arguments:
        train: True normalises with batch statistics and returns updated running statistics (torch's
            `model.train()`); False uses the running statistics and returns `state` unchanged.
        key: dropout before the classifier when given (training); no dropout without one.
        axis_name: a named axis (shard_map, or vmap with axis_name) to average batch statistics over, so
            data-parallel training normalises every shard with the global batch's statistics.
    """
    blocks = config.blocks()
    expected = ("stem", *(b.name for b in blocks), *(("last",) if config.version == "v2" else ()))
    check_keys(params, f"mobilenet ({config.version})", required=(*expected, "classifier"))
    check_keys(state, f"mobilenet ({config.version}) state", required=expected)
    x = jnp.asarray(x)
    if x.ndim != 4 or x.shape[-1] != config.in_channels:
        raise ValueError(
            f"mobilenet: x must be (batch, height, width, {config.in_channels}) NHWC images to match "
            f"config.in_channels, got shape {x.shape}"
        )
    act = activations.relu6 if config.version == "v2" else activations.relu
    new_state = {}
    h, new_state["stem"] = unit_apply(params["stem"], state["stem"], x, config, stride=config.stem_stride,
                                      train=train, axis_name=axis_name)  # fmt: skip
    h = act(h)
    for block in blocks:
        h, new_state[block.name] = block_apply(params[block.name], state[block.name], h, block, config,
                                               train=train, axis_name=axis_name)  # fmt: skip
    if config.version == "v2":
        h, new_state["last"] = unit_apply(params["last"], state["last"], h, config, train=train, axis_name=axis_name)
        h = act(h)
    h = dropout.apply(pooling.global_avg_pool(h), config.dropout, key)
    return linear.apply(params["classifier"], h), (new_state if train else state)


def layer_table(config: MobileNetConfig) -> list[tuple[str, str, tuple[int, int, int], int]]:
    """(name, what, output (height, width, channels), stride) per layer: the tables in docs/mobilenet.md."""
    size = -(-config.image_size // config.stem_stride)
    rows = [("stem", "3x3 conv, BN, ReLU6" if config.version == "v2" else "3x3 conv, BN, ReLU",
             (size, size, config.stem_channels), config.stem_stride)]  # fmt: skip
    for b in config.blocks():
        what = f"inverted residual t={b.expand}" if config.version == "v2" else "depthwise separable"
        if config.version == "v2" and b.stride == 1 and b.in_channels == b.out_channels:
            what += " +x"
        rows.append((b.name, what, (b.out_size, b.out_size, b.out_channels), b.stride))
    final = config.final_size
    if config.version == "v2":
        rows.append(("last", "1x1 conv, BN, ReLU6", (final, final, config.last_channels), 1))
    rows.append(("classifier", "avg pool, dropout, linear", (1, 1, config.num_classes), 1))
    return rows
