"""MobileNet's plan: the stage tables, the width multiplier's rounding and the stride plan for small images,
everything `MobileNetConfig` decides before a single weight exists. The network itself, the maths that runs on
images, is models/mobilenet.py; this page is what it reads its shapes from.

Width multiplier (`width_mult`, torchvision's name; a factor, not a width): every channel count c becomes
`make_divisible(c * width_mult)`, rounded to a multiple of 8, and the last conv keeps 1280 channels below
width_mult 1 and grows above it (torchvision's rule).

Small images: a 224 image passes five stride-2 layers (the stem and the first block of four stages) and ends
7x7. A small image cannot: `MobileNetConfig.num_downsamples` keeps the most stride-2 layers, up to five, that
leave the final feature map at least 4x4, and turns the *earliest* ones into stride 1 (as CIFAR adaptations
of MobileNetV2 do: downsampling a small image before any features exist throws detail away). So 224 keeps all
five (7x7), 32 and 28 keep three (4x4), 8 keeps one (the 160-channel stage, 8x8 -> 4x4). Set it explicitly to
override the rule, e.g. 5 to run torchvision's exact network on any input.
"""

from dataclasses import dataclass
from typing import Literal, NamedTuple

from purejax.nn import conv

# MobileNetV2 stages (t expansion, c channels, n blocks, s stride of the first block): the paper's Table 2.
V2_STAGES: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
# MobileNetV1 depthwise-separable blocks (c channels, s stride): the paper's Table 1.
V1_BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    *[(512, 1)] * 5,
    (1024, 2),
    (1024, 1),
)
STEM_CHANNELS = 32
LAST_CHANNELS = 1280  # V2's last 1x1 conv
MAX_DOWNSAMPLES = 5  # the stem and four stages: a 224 image ends 7x7
MIN_FINAL_SIZE = 4  # the adapted-stem rule keeps the final feature map at least this big


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
        n_classes: classifier outputs (1000 for ImageNet).
        image_size: the input height and width the stride plan is made for (see `num_downsamples`).
        in_channels: 3 for RGB, 1 for greyscale.
        width_mult: the width multiplier alpha (torchvision's name); channels are rounded to multiples of 8
            (`make_divisible`).
        dropout: rate before the classifier, applied when `apply` gets a key (torchvision: 0.2).
        num_downsamples: how many of the five stride-2 layers keep stride 2 (the earliest become stride 1);
            None applies the module docstring's rule for `image_size`.
        depthwise_impl: how the 3x3 depthwise convs run (`purejax.nn.conv`: "auto", "xla" or "shifts").
        bn_momentum, bn_eps: BatchNorm's settings, torch's convention and defaults.
    """

    version: Literal["v1", "v2"] = "v2"
    n_classes: int = 1000
    image_size: int = 224
    in_channels: int = 3
    width_mult: float = 1.0
    dropout: float = 0.2
    num_downsamples: int | None = None
    depthwise_impl: conv.DepthwiseImpl = "auto"
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5

    def __post_init__(self):
        if self.version not in ("v1", "v2"):
            raise ValueError(f"MobileNetConfig: version must be 'v1' or 'v2', got {self.version!r}")
        for name in ("n_classes", "image_size", "in_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MobileNetConfig: {name} must be a positive int, got {value!r}")
        if self.n_classes < 2:
            raise ValueError(f"MobileNetConfig: n_classes must be at least 2, got {self.n_classes}")
        if not self.width_mult > 0:
            raise ValueError(f"MobileNetConfig: width_mult must be positive, got {self.width_mult!r}")
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
        return make_divisible(STEM_CHANNELS * self.width_mult)

    @property
    def stem_stride(self) -> int:
        return 2 if self.downsamples == MAX_DOWNSAMPLES else 1

    @property
    def last_channels(self) -> int:
        """Channels into the classifier: V2's last conv (1280, scaled only when width_mult > 1), V1's last block."""
        if self.version == "v1":
            return self.blocks()[-1].out_channels
        return make_divisible(LAST_CHANNELS * max(1.0, self.width_mult))

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
            channels = make_divisible(c * self.width_mult)
            out.append(Block(f"block_{len(out)}", in_channels, channels, t, stride, size))
            in_channels = channels
        return tuple(out)

    @property
    def final_size(self) -> int:
        """Height of the feature map that is pooled: 7 for 224, 4 for the small inputs of the rule."""
        return self.blocks()[-1].out_size


def layer_table(config: MobileNetConfig) -> list[tuple[str, str, tuple[int, int, int], int]]:
    """(name, what, output (height, width, channels), stride) per layer: the tables in docs/mobilenet.md."""
    size = -(-config.image_size // config.stem_stride)
    rows = [
        (
            "stem",
            "3x3 conv, BN, ReLU6" if config.version == "v2" else "3x3 conv, BN, ReLU",
            (size, size, config.stem_channels),
            config.stem_stride,
        )
    ]
    for b in config.blocks():
        what = f"inverted residual t={b.expand}" if config.version == "v2" else "depthwise separable"
        if config.version == "v2" and b.stride == 1 and b.in_channels == b.out_channels:
            what += " +x"
        rows.append((b.name, what, (b.out_size, b.out_size, b.out_channels), b.stride))
    final = config.final_size
    if config.version == "v2":
        rows.append(("last", "1x1 conv, BN, ReLU6", (final, final, config.last_channels), 1))
    rows.append(("classifier", "avg pool, dropout, linear", (1, 1, config.n_classes), 1))
    return rows
