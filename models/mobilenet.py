"""MobileNetV2 (Sandler et al. 2018, arXiv:1801.04381) and MobileNetV1 (Howard et al. 2017, arXiv:1704.04861)
over NHWC images, with BatchNorm's running statistics as explicit state.

V2, torchvision's layout (shapes for a 224x224 image at width_mult 1.0):
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

The channel counts, strides and the stride plan for small images come from `MobileNetConfig`
(models/mobilenet_config.py, re-exported here): this page is the network that runs on images.

Padding is symmetric as in torch: `padding=1` for every 3x3 conv, stride 1 or 2 (XLA's "SAME" would pad a
stride-2 conv on an even image only at the bottom and right, which shifts every feature by half a pixel and
breaks imported weights).
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from models.mobilenet_config import (  # noqa: F401 - re-exported: mobilenet.MobileNetConfig is the API
    V1_BLOCKS,
    V2_STAGES,
    Block,
    MobileNetConfig,
    layer_table,
    make_divisible,
)
from purejax import random as prandom
from purejax.nn import activations, batch_norm, check_keys, check_shape, conv, dropout, initializers, linear, pooling

Params = dict[str, Any]
State = dict[str, Any]

# torchvision's initialisation: He normal with fan_out for convs, N(0, 0.01) for the classifier, BN 1 and 0.
CONV_INIT = initializers.variance_scaling(2.0, "fan_out", "normal")
CLASSIFIER_INIT = initializers.normal(0.01)


# ---------------------------------------------------------------- conv -> BN (-> activation), the one unit


def unit_init(key: PRNGKeyArray, in_channels: int, out_channels: int, kernel: int, *, groups: int = 1) -> Params:
    """A bias-free conv and the BatchNorm after it: {"conv": {"w"}, "bn": {"scale", "bias"}}."""
    keys = prandom.named_keys(key, "conv", "bn")
    w = conv.init(keys["conv"], in_channels, out_channels, kernel, groups=groups, bias=False, w_init=CONV_INIT)
    return {"conv": w, "bn": batch_norm.init(keys["bn"], out_channels)}


def unit_state(out_channels: int) -> State:
    return {"bn": batch_norm.init_state(out_channels)}


def unit_apply(
    params: Params,
    x: Float[Array, "batch height width in_channels"],
    state: State,
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
    y, bn_state = batch_norm.apply(
        params["bn"], y, state["bn"], train=train, momentum=config.bn_momentum, eps=config.bn_eps, axis_name=axis_name
    )
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
    x: Float[Array, "batch height width in_channels"],
    state: State,
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
        h, new_state[name] = unit_apply(
            params[name],
            h,
            state[name],
            config,
            stride=block.stride if depthwise else 1,
            depthwise=depthwise,
            train=train,
            axis_name=axis_name,
        )
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
        params[block.name] = {
            name: unit_init(unit_keys[name], c_in, c_out, kernel, groups=groups)
            for name, (c_in, c_out, kernel, groups) in units.items()
        }
    if config.version == "v2":
        params["last"] = unit_init(keys["last"], blocks[-1].out_channels, config.last_channels, 1)
    params["classifier"] = linear.init(
        keys["classifier"], config.last_channels, config.n_classes, w_init=CLASSIFIER_INIT
    )
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
    x: Float[ArrayLike, "batch height width in_channels"],
    state: State,
    config: MobileNetConfig,
    *,
    train: bool,
    key: PRNGKeyArray | None = None,
    axis_name: Any = None,
) -> tuple[Float[Array, "batch n_classes"], State]:
    """(logits, new_state) for the NHWC images `x`: the layer contract's order for a stateful model, the state
    after the input and the static config last (docs/design.md).

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
    check_shape("mobilenet", "x", x, ("batch", "height", "width", config.in_channels), "config.in_channels")
    act = activations.relu6 if config.version == "v2" else activations.relu
    new_state = {}
    h, new_state["stem"] = unit_apply(
        params["stem"], x, state["stem"], config, stride=config.stem_stride, train=train, axis_name=axis_name
    )
    h = act(h)
    for block in blocks:
        h, new_state[block.name] = block_apply(
            params[block.name], h, state[block.name], block, config, train=train, axis_name=axis_name
        )
    if config.version == "v2":
        h, new_state["last"] = unit_apply(params["last"], h, state["last"], config, train=train, axis_name=axis_name)
        h = act(h)
    h = dropout.apply(pooling.global_avg_pool(h), rate=config.dropout, key=key)
    return linear.apply(params["classifier"], h), (new_state if train else state)
