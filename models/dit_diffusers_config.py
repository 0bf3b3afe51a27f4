"""The config.json side of diffusers' DiT (`DiTTransformer2DModel`): which settings map to which `DiTConfig`
fields, and which DiTs have no diffusers equivalent. The weights are models/dit_diffusers.py's.

    diffusers                                    DiTConfig
    sample_size, patch_size, in_channels         input_size, patch_size, in_channels
    num_attention_heads * attention_head_dim     d_model (n_head = num_attention_heads)
    num_layers, num_embeds_ada_norm              n_layer, n_classes (the class table has one more row: null)
    out_channels = 2 * in_channels               learn_sigma=True
    norm_eps (the LayerNorm before each MLP)     mlp_norm_eps
    (fixed) 4x MLP, 256 timestep features,       mlp_ratio=4, freq_dim=256, max_period=10000,
            downscale_freq_shift=1                    freq_shift=1
"""

from collections.abc import Mapping
from typing import Any, Literal

from models import dit

CLASS_NAME = "DiTTransformer2DModel"

# Defaults of the two diffusers classes that hold a DiT, for settings a config.json leaves out. diffusers' first
# DiT conversions (facebook/DiT-XL-2-256) were saved as Transformer2DModel, whose defaults are not DiT's.
_DIT_DEFAULTS = {
    "num_attention_heads": 16,
    "attention_head_dim": 72,
    "in_channels": 4,
    "out_channels": None,
    "num_layers": 28,
    "sample_size": 32,
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "attention_bias": True,
    "norm_type": "ada_norm_zero",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-5,
}
_TRANSFORMER_2D_DEFAULTS = {
    **_DIT_DEFAULTS,
    "attention_head_dim": 88,
    "in_channels": None,
    "num_layers": 1,
    "sample_size": None,
    "patch_size": None,
    "activation_fn": "geglu",
    "num_embeds_ada_norm": None,
    "attention_bias": False,
    "norm_type": "layer_norm",
    "norm_elementwise_affine": True,
}
DEFAULTS = {CLASS_NAME: _DIT_DEFAULTS, "Transformer2DModel": _TRANSFORMER_2D_DEFAULTS}
# Settings whose other values are other architectures (cross-attention, other norms or activations).
REQUIRED = {
    "norm_type": "ada_norm_zero",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "norm_elementwise_affine": False,
    "cross_attention_dim": None,
    "num_vector_embeds": None,
}
SIZES = (
    "sample_size",
    "patch_size",
    "in_channels",
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
    "num_embeds_ada_norm",
)


def config_from_diffusers(
    hf: Mapping[str, Any],
    source: str = "config.json",
    *,
    time_scale: float = 1.0,
    layers: Literal["scan", "loop"] = "scan",
) -> dit.DiTConfig:
    """A DiTConfig from a diffusers DiT config.json (as a dict); every unsupported setting is listed in one
    ValueError. `time_scale` and `layers` are ours, not in the file: diffusers' DiT takes t as its pipeline
    gives it (DDPM's integer steps: 1; a flow-matching scheduler's t * 1000: 1000 if you pass t in [0, 1]).
    `dropout` (training only; this DiT has none) and `upcast_attention` (softmax is float32 here anyway) are
    read past: neither changes what the forward pass computes."""
    name = hf.get("_class_name", CLASS_NAME)
    if name not in DEFAULTS:
        raise ValueError(f"{source}: _class_name {name!r} is not a diffusers DiT; expected one of {sorted(DEFAULTS)}")
    hf = {**DEFAULTS[name], **hf}
    problems = [
        f"{key}={hf.get(key, want)!r}, only {want!r} is supported (a DiT with adaLN-Zero blocks)"
        for key, want in REQUIRED.items()
        if hf.get(key, want) != want
    ]
    problems += [
        f"{key}={hf[key]!r} is not a positive int"
        for key in SIZES
        if isinstance(hf[key], bool) or not isinstance(hf[key], int) or hf[key] <= 0
    ]
    if not problems and hf["out_channels"] not in (None, hf["in_channels"], 2 * hf["in_channels"]):
        problems.append(
            f"out_channels={hf['out_channels']}: DiT outputs in_channels={hf['in_channels']} channels, "
            f"or twice that with learned sigma"
        )
    if problems:
        raise ValueError(f"{source}: unsupported diffusers DiT settings:\n  " + "\n  ".join(problems))
    try:
        return dit.DiTConfig(
            input_size=hf["sample_size"],
            patch_size=hf["patch_size"],
            in_channels=hf["in_channels"],
            d_model=hf["num_attention_heads"] * hf["attention_head_dim"],
            n_layer=hf["num_layers"],
            n_head=hf["num_attention_heads"],
            mlp_ratio=4.0,
            n_classes=hf["num_embeds_ada_norm"],
            learn_sigma=hf["out_channels"] == 2 * hf["in_channels"],
            time_scale=time_scale,
            freq_shift=1.0,
            freq_dim=256,
            max_period=10000.0,
            mlp_norm_eps=float(hf["norm_eps"]),
            layers=layers,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def config_to_diffusers(config: dit.DiTConfig) -> dict[str, Any]:
    """The config.json of a diffusers DiTTransformer2DModel with this architecture (time_scale is not in it:
    that model embeds the t it is given, so pass it time_scale * t)."""
    check_representable(config, "dit_diffusers")
    return {
        "_class_name": CLASS_NAME,
        "num_attention_heads": config.n_head,
        "attention_head_dim": config.d_model // config.n_head,
        "in_channels": config.in_channels,
        "out_channels": config.out_channels,
        "num_layers": config.n_layer,
        "dropout": 0.0,
        "norm_num_groups": 32,
        "attention_bias": True,
        "sample_size": config.input_size,
        "patch_size": config.patch_size,
        "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": config.n_classes,
        "upcast_attention": False,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": config.mlp_norm_eps,
    }


def check_representable(config: dit.DiTConfig, where: str) -> None:
    """Refuse, listing every reason, a DiT that diffusers' DiTTransformer2DModel would compute differently."""
    problems = [f"n_mixer={config.n_mixer}: diffusers' DiT has no patch-mixer blocks"] if config.n_mixer else []
    if config.n_experts:
        problems.append(f"n_experts={config.n_experts}: diffusers' DiT has dense MLPs")
    if config.d_ff != 4 * config.d_model:
        problems.append(f"mlp_ratio={config.mlp_ratio}: diffusers' DiT MLP is 4 * d_model wide")
    if (config.freq_dim, config.max_period) != (256, 10000.0):
        problems.append(
            f"freq_dim={config.freq_dim}, max_period={config.max_period}: diffusers' DiT embeds time "
            f"with 256 features and max_period 10000"
        )
    if config.freq_shift != 1.0:
        problems.append(
            f"freq_shift={config.freq_shift}: diffusers' timestep features use downscale_freq_shift=1 "
            f"(DiT's own code uses 0), so this model would see other features of t there"
        )
    if problems:
        raise ValueError(f"{where}: this DiTConfig has no diffusers equivalent:\n  " + "\n  ".join(problems))
