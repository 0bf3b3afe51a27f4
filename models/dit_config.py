"""DiT's sizes: `DiTConfig`, everything a DiT is before a single weight exists, with the checks that make an
impossible one fail when it is built; and `preset`, the named sizes of DiT's table 1 ("XL/2" is DiT-XL/2).
The model itself, the maths that runs on images, is models/dit.py.
"""

from dataclasses import dataclass
from typing import Any, Literal

from purejax.nn import attention
from purejax.nn import remat as remat_lib

# (n_layer, d_model, n_head) of DiT's table 1, plus two sizes small enough to train on a CPU.
SIZES = {
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
    "Ti": (4, 128, 4),
    "Nano": (2, 64, 2),
}
NORM_EPS = 1e-6  # DiT's LayerNorms (before attention, before the MLP, in the final layer)


@dataclass(frozen=True)
class DiTConfig:
    """Static description of a DiT; frozen and hashable, so it can be a static argument to jax.jit. Field
    names are DiT's where purejax.nn has none of its own (`mlp_ratio`, `learn_sigma`, `freq_dim`).

    Arguments:
        input_size: height and width of the (square) input, in pixels or latent cells (DiT: 32, a 256x256
            image through Stable Diffusion's VAE).
        patch_size: side of a patch; seq = (input_size // patch_size) ** 2 tokens.
        in_channels: channels of the input (DiT: 4 latent channels).
        d_model, n_layer, n_head: width, depth and attention heads of the backbone.
        mlp_ratio: the MLP's hidden width d_ff is d_model * mlp_ratio.
        n_classes: class labels 0..n_classes-1; id n_classes is the null class ("no label"), the
            unconditional input of classifier-free guidance.
        learn_sigma: output 2 * in_channels channels, the second half the variance (DiT's learned sigma for
            DDPM); False for flow matching, which predicts a velocity only.
        time_scale: t is multiplied by this before its embedding. 1 for DDPM's integer steps 0..999; 1000
            for rectified flow's t in [0, 1] (SD3 does the same), so the frequencies see the same range.
        freq_shift: the timestep embedding's frequencies are exp(-ln(max_period) * i / (half - freq_shift)):
            0 is DiT's original (`TimestepEmbedder`), 1 is diffusers' (`downscale_freq_shift=1`).
        freq_dim, max_period: size and longest period of the sinusoidal timestep features (DiT: 256, 10000).
        mlp_norm_eps: epsilon of the LayerNorm before each block's MLP. DiT uses 1e-6 in every norm;
            diffusers' DiTTransformer2DModel takes this one from its config (`norm_eps`, default 1e-5) and
            keeps 1e-6 before attention and in the final layer, so its checkpoints load with their own value.
        n_mixer: MicroDiT's patch-mixer depth: blocks run over all tokens before masking; 0: plain DiT.
        n_experts, top_k: mixture-of-experts MLPs in the backbone blocks (0: dense MLPs); each token goes to
            its top_k experts (`dit_moe`).
        layers: "scan" (compile time flat in depth) or "loop" (unrolled); the same maths.
        remat: "none", "block" or a policy: what each block keeps for the backward pass (purejax/nn/remat.py).
    """

    input_size: int = 32
    patch_size: int = 2
    in_channels: int = 4
    d_model: int = 1152
    n_layer: int = 28
    n_head: int = 16
    mlp_ratio: float = 4.0
    n_classes: int = 1000
    learn_sigma: bool = True
    time_scale: float = 1.0
    freq_shift: float = 0.0
    freq_dim: int = 256
    max_period: float = 10000.0
    mlp_norm_eps: float = NORM_EPS
    n_mixer: int = 0
    n_experts: int = 0
    top_k: int = 2
    layers: Literal["scan", "loop"] = "scan"
    remat: str = "none"

    def __post_init__(self):
        for name in (
            "input_size",
            "patch_size",
            "in_channels",
            "d_model",
            "n_layer",
            "n_head",
            "n_classes",
            "freq_dim",
            "top_k",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DiTConfig: {name} must be a positive int, got {value!r}")
        if self.input_size % self.patch_size:
            raise ValueError(
                f"DiTConfig: input_size={self.input_size} is not divisible by patch_size={self.patch_size}"
            )
        if self.d_model % 4:
            raise ValueError(
                f"DiTConfig: d_model={self.d_model} must be divisible by 4 (2-D sin-cos positions: "
                f"a sine and a cosine per axis)"
            )
        if self.freq_dim < 4 or not 0 <= self.freq_shift < self.freq_dim // 2:
            raise ValueError(
                f"DiTConfig: need freq_dim >= 4 and 0 <= freq_shift < freq_dim // 2, got "
                f"freq_dim={self.freq_dim}, freq_shift={self.freq_shift}"
            )
        if self.n_mixer < 0 or self.n_experts < 0 or self.n_experts == 1:
            raise ValueError(
                f"DiTConfig: n_mixer must be >= 0 and n_experts 0 or >= 2, got {self.n_mixer}, {self.n_experts}"
            )
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"DiTConfig: top_k={self.top_k} is more than n_experts={self.n_experts}")
        for name in ("mlp_ratio", "time_scale", "max_period", "mlp_norm_eps"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"DiTConfig: {name} must be positive, got {getattr(self, name)}")
        if self.layers not in ("scan", "loop"):
            raise ValueError(f"DiTConfig: layers must be 'scan' or 'loop', got {self.layers!r}")
        remat_lib.check(self.remat)
        self.attention  # noqa: B018 - builds the AttentionConfig, so a bad n_head fails here

    @property
    def attention(self) -> attention.AttentionConfig:
        return attention.AttentionConfig(d_model=self.d_model, n_head=self.n_head, bias=True, causal=False)

    @property
    def grid(self) -> int:
        return self.input_size // self.patch_size

    @property
    def seq(self) -> int:
        return self.grid**2

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def d_ff(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    @property
    def null_class(self) -> int:
        return self.n_classes


def preset(name: str, **overrides: Any) -> DiTConfig:
    """A named size with its patch: "XL/2" is DiT-XL/2 (28 layers, 1152 wide, 16 heads, patch 2); "S/8",
    "B/4", "L/2", and the CPU sizes "Ti/2" and "Nano/2". `overrides` set any other field."""
    size, _, patch = name.partition("/")
    if size not in SIZES or patch not in ("1", "2", "4", "8"):
        raise ValueError(
            f"dit.preset: unknown name {name!r}; use <size>/<patch> with size in {sorted(SIZES)} "
            f"and patch 1, 2, 4 or 8, e.g. 'XL/2'"
        )
    n_layer, d_model, n_head = SIZES[size]
    return DiTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, patch_size=int(patch), **overrides)
