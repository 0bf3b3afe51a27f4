"""DiT, the diffusion transformer (Peebles & Xie 2023, arXiv:2212.09748), and MicroDiT's deferred masking
(Sehwag et al. 2024, arXiv:2407.15811), as pure functions over a dict of arrays.

    x (batch, height, width, channels), t (batch,), y (batch,) class ids, n_classes = the null class
      -> patchify: (batch, seq, patch*patch*channels) -> linear -> + fixed 2-D sin-cos positions
                                                                          tokens (batch, seq, d_model)
      c = mlp(sinusoidal(time_scale * t)) + class_table[y]                c (batch, d_model)
      -> [MicroDiT] n_mixer blocks over all tokens, then keep a random (1 - mask_ratio) of the tokens
      -> n_layer adaLN-Zero blocks, each conditioned on c                  tokens (batch, kept, d_model)
      -> final adaLN layer, linear to patch*patch*out_channels, unpatchify
                                                                          out (batch, height, width, out_channels)

An adaLN-Zero block regresses six vectors from c (shift, scale and gate for attention and for the MLP):
`x + gate * attn(norm(x) * (1 + scale) + shift)`, then the same for the MLP. The norms have no parameters of
their own (adaLN's shift and scale take their place), and the regression is initialised to zero, so gate = 0
and every block starts as the identity; the final layer's modulation and projection are zero too, so the
untrained model outputs zeros (DiT sec. 3.2, "adaLN-Zero").

params: {"patch": linear (patch*patch*in_channels, d_model), "t_mlp": mlp (freq_dim -> d_model -> d_model),
         "classes": embedding (n_classes + 1, d_model), ["mixer": blocks,] "blocks": {"adaln", "attn", "mlp"
         (or "moe"), every leaf stacked on a leading layer axis}, "final": {"adaln", "proj"}}.
Blocks run under `lax.scan` (`purejax.nn.stack`) or, with `layers="loop"`, as a Python loop.

MicroDiT ("Stretching Each Dollar"): the patch-mixer sees every token, so information from patches that are
then dropped still reaches the kept ones; the backbone runs on the kept tokens only, which is where the
training compute is saved, and the loss is taken on the kept patches (`apply_masked` returns which pixels
they cover). With mask_ratio 0 (fine-tuning, sampling) `apply_masked` is `apply`. Optional mixture-of-experts
MLPs (`n_experts > 0`) replace the backbone's MLPs with token-choice top-k routing; see `moe_apply`.
"""

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, Real, Shaped

from purejax import random as prandom
from purejax.nn import activations, attention, embedding, initializers, layer_norm, linear, mlp, stack
from purejax.nn import check_keys

Params = dict[str, Any]

# (n_layer, d_model, n_head) of DiT's table 1, plus two sizes small enough to train on a CPU.
SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16),
         "Ti": (4, 128, 4), "Nano": (2, 64, 2)}  # fmt: skip


@dataclass(frozen=True)
class DiTConfig:
    """Static description of a DiT; frozen and hashable, so it can be a static argument to jax.jit.

    Arguments:
        input_size: height and width of the (square) input, in pixels or latent cells (DiT: 32, a 256x256
            image through Stable Diffusion's VAE).
        patch_size: side of a patch; seq = (input_size // patch_size) ** 2 tokens.
        in_channels: channels of the input (DiT: 4 latent channels).
        d_model, n_layer, n_head: width, depth and attention heads of the backbone.
        mlp_ratio: the MLP's hidden width is d_model * mlp_ratio.
        n_classes: class labels 0..n_classes-1; id n_classes is the null class ("no label"), the
            unconditional input of classifier-free guidance.
        learn_sigma: output 2 * in_channels channels, the second half the variance (DiT's learned sigma for
            DDPM); False for flow matching, which predicts a velocity only.
        time_scale: t is multiplied by this before its embedding. 1 for DDPM's integer steps 0..999; 1000
            for rectified flow's t in [0, 1] (SD3 does the same), so the frequencies see the same range.
        freq_shift: the timestep embedding's frequencies are exp(-ln(max_period) * i / (half - freq_shift)):
            0 is DiT's original (`TimestepEmbedder`), 1 is diffusers' (`downscale_freq_shift=1`).
        freq_dim, max_period: size and longest period of the sinusoidal timestep features (DiT: 256, 10000).
        n_mixer: MicroDiT's patch-mixer depth: blocks run over all tokens before masking; 0: plain DiT.
        n_experts, top_k: mixture-of-experts MLPs in the backbone blocks (0: dense MLPs); each token goes to
            its top_k experts.
        layers: "scan" (compile time flat in depth) or "loop" (unrolled); the same maths.
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
    n_mixer: int = 0
    n_experts: int = 0
    top_k: int = 2
    layers: Literal["scan", "loop"] = "scan"

    def __post_init__(self):
        for name in ("input_size", "patch_size", "in_channels", "d_model", "n_layer", "n_head", "n_classes",
                     "freq_dim", "top_k"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DiTConfig: {name} must be a positive int, got {value!r}")
        if self.input_size % self.patch_size:
            raise ValueError(f"DiTConfig: input_size={self.input_size} is not divisible by patch_size={self.patch_size}")
        if self.d_model % 4:
            raise ValueError(f"DiTConfig: d_model={self.d_model} must be divisible by 4 (2-D sin-cos positions: "
                             f"a sine and a cosine per axis)")  # fmt: skip
        if self.freq_dim < 4 or not 0 <= self.freq_shift < self.freq_dim // 2:
            raise ValueError(f"DiTConfig: need freq_dim >= 4 and 0 <= freq_shift < freq_dim // 2, got "
                             f"freq_dim={self.freq_dim}, freq_shift={self.freq_shift}")  # fmt: skip
        if self.n_mixer < 0 or self.n_experts < 0 or self.n_experts == 1:
            raise ValueError(f"DiTConfig: n_mixer must be >= 0 and n_experts 0 or >= 2, got {self.n_mixer}, {self.n_experts}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"DiTConfig: top_k={self.top_k} is more than n_experts={self.n_experts}")
        if self.mlp_ratio <= 0 or self.time_scale <= 0:
            raise ValueError(f"DiTConfig: mlp_ratio and time_scale must be positive, got {self.mlp_ratio}, {self.time_scale}")
        if self.layers not in ("scan", "loop"):
            raise ValueError(f"DiTConfig: layers must be 'scan' or 'loop', got {self.layers!r}")
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
    def d_hidden(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    @property
    def null_class(self) -> int:
        return self.n_classes


def preset(name: str, **overrides: Any) -> DiTConfig:
    """A named size with its patch: "XL/2" is DiT-XL/2 (28 layers, 1152 wide, 16 heads, patch 2); "S/8",
    "B/4", "L/2", and the CPU sizes "Ti/2" and "Nano/2". `overrides` set any other field."""
    size, _, patch = name.partition("/")
    if size not in SIZES or patch not in ("1", "2", "4", "8"):
        raise ValueError(f"dit.preset: unknown name {name!r}; use <size>/<patch> with size in {sorted(SIZES)} "
                         f"and patch 1, 2, 4 or 8, e.g. 'XL/2'")  # fmt: skip
    n_layer, d_model, n_head = SIZES[size]
    return DiTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, patch_size=int(patch), **overrides)


# ---------------------------------------------------------------- embeddings


def patchify(x: Shaped[Array, "batch height width channels"], patch: int) -> Shaped[Array, "batch seq patch_dim"]:
    """Non-overlapping patch x patch squares, row-major over the grid, each flattened in (row, column,
    channel) order: the same as a stride-`patch` convolution whose HWIO kernel is reshaped to (patch_dim, d)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(tokens: Shaped[Array, "batch seq patch_dim"], patch: int, channels: int) -> Shaped[Array, "batch height width channels"]:
    """The inverse of `patchify` for a square grid (DiT's `unpatchify`)."""
    b, seq, _ = tokens.shape
    grid = math.isqrt(seq)
    x = tokens.reshape(b, grid, grid, patch, patch, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, grid * patch, grid * patch, channels)


def sincos_1d(d: int, positions: Real[ArrayLike, " n"]) -> Float[Array, "n d"]:
    """[sin(p * w_i), cos(p * w_i)] with w_i = 10000^(-i / (d/2)), i < d/2 (MAE's and DiT's 1-D table)."""
    omega = 1.0 / 10000.0 ** (jnp.arange(d // 2, dtype=jnp.float32) / (d // 2))
    angles = jnp.asarray(positions, jnp.float32)[:, None] * omega
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def sincos_2d(d: int, grid: int) -> Float[Array, "seq d"]:
    """Fixed 2-D positions for a row-major grid x grid of tokens: the first d/2 features encode the column,
    the last d/2 the row. (DiT's `get_2d_sincos_pos_embed` builds `meshgrid(w, h)`, so its half named "h"
    is the column; this matches it, so DiT checkpoints see the positions they were trained with.)"""
    rows, cols = jnp.divmod(jnp.arange(grid * grid), grid)
    return jnp.concatenate([sincos_1d(d // 2, cols), sincos_1d(d // 2, rows)], axis=-1)


def timestep_embedding(
    t: Real[ArrayLike, " batch"], dim: int, *, max_period: float = 10000.0, freq_shift: float = 0.0
) -> Float[Array, "batch dim"]:
    """[cos(t * f_i), sin(t * f_i)], f_i = exp(-ln(max_period) * i / (half - freq_shift)), i < half = dim // 2,
    float32; an odd dim gets a zero last column. freq_shift 0 is DiT's convention, 1 diffusers' (whose
    `flip_sin_to_cos=True` also puts the cosines first)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    angles = jnp.asarray(t, jnp.float32)[:, None] * freqs
    emb = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


# ---------------------------------------------------------------- blocks


def modulate(x: Float[Array, "batch seq d"], shift: Float[Array, "batch d"], scale: Float[Array, "batch d"]) -> Float[Array, "batch seq d"]:
    """adaLN: x * (1 + scale) + shift, per sample (scale 0 is the identity, hence the 1 +)."""
    return x * (1 + scale[:, None]) + shift[:, None]


def norm(x: Float[Array, "batch seq d"]) -> Float[Array, "batch seq d"]:
    """LayerNorm without parameters, eps 1e-6 (DiT's `elementwise_affine=False`): adaLN supplies scale and shift."""
    return layer_norm.apply({"scale": jnp.ones(x.shape[-1], x.dtype)}, x, eps=1e-6)


def block_init(key: PRNGKeyArray, config: DiTConfig, moe: bool = False) -> Params:
    """One adaLN-Zero block: xavier-uniform linears (DiT's `initialize_weights`), zero modulation."""
    keys = prandom.named_keys(key, "adaln", "attn", "mlp")
    d, xavier = config.d_model, initializers.xavier_uniform()
    params = {
        "adaln": linear.init(keys["adaln"], d, 6 * d, w_init=initializers.zeros),
        "attn": attention.init(keys["attn"], config.attention, w_init=xavier),
    }
    if moe:
        params["moe"] = moe_init(keys["mlp"], d, config.d_hidden, config.n_experts)
    else:
        params["mlp"] = mlp.init(keys["mlp"], d, config.d_hidden, w_init=xavier)
    return params


def block(params: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"], config: DiTConfig) -> Float[Array, "batch seq d_model"]:
    """x + gate_msa * attn(modulate(norm(x))), then x + gate_mlp * mlp(modulate(norm(x))), DiT's order of the
    six modulation vectors."""
    mod = linear.apply(params["adaln"], jax.nn.silu(c))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
    h = modulate(norm(x), shift_msa, scale_msa)
    x = x + gate_msa[:, None] * attention.apply(params["attn"], h, config.attention)
    h = modulate(norm(x), shift_mlp, scale_mlp)
    if "moe" in params:
        h = moe_apply(params["moe"], h, config.top_k)
    else:
        h = mlp.apply(params["mlp"], h, activation=activations.gelu_tanh)  # DiT: GELU(approximate="tanh")
    return x + gate_mlp[:, None] * h


def moe_init(key: PRNGKeyArray, d: int, d_hidden: int, n_experts: int) -> Params:
    """A router (d -> n_experts, small normal weights N(0, 0.02^2): near-uniform routing at the start, but not
    all tokens tied on the same experts, as zeros would make them) and n_experts MLPs stacked on a leading
    expert axis."""
    keys, xavier = prandom.named_keys(key, "router", "experts"), initializers.xavier_uniform()
    return {
        "router": linear.init(keys["router"], d, n_experts, bias=False, w_init=initializers.normal(0.02)),
        "experts": stack.init(keys["experts"], n_experts, lambda k: mlp.init(k, d, d_hidden, w_init=xavier)),
    }


def moe_apply(params: Params, x: Float[Array, "batch seq d"], top_k: int) -> Float[Array, "batch seq d"]:
    """Token-choice top-k mixture of experts: sum over each token's top_k experts of gate * expert(x), gates
    the router's softmax renormalised over the chosen experts (Shazeer et al. 2017; Mixtral). With top_k=1
    the gate is the chosen expert's softmax probability itself (Switch Transformer): renormalised it would
    always be 1, and the router would get no gradient.

    Every expert runs on every token and the unchosen outputs get weight 0: exact, simple, and cheap for the
    few experts of a small model; it is not the dispatch a large MoE needs. MicroDiT itself uses
    expert-choice routing in every other block; no load-balancing loss is applied here."""
    logits = linear.apply(params["router"], x).astype(jnp.float32)
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    gates = top if top_k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(chosen, logits.shape[-1]) * gates[..., None], axis=-2)  # (batch, seq, E)
    outs = jax.vmap(lambda p: mlp.apply(p, x, activation=activations.gelu_tanh))(params["experts"])
    return jnp.einsum("bse,ebsd->bsd", weights.astype(x.dtype), outs)


def run_blocks(blocks: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"], config: DiTConfig) -> Float[Array, "batch seq d_model"]:
    """The stacked blocks, under scan or as a loop (`config.layers`)."""
    step = lambda p, x: block(p, x, c, config)  # noqa: E731
    if config.layers == "scan":
        return stack.scan(step, blocks, x)
    return stack.loop(step, stack.unstack(blocks), x)


# ---------------------------------------------------------------- the model


def init(key: PRNGKeyArray, config: DiTConfig) -> Params:
    """DiT's `initialize_weights`: xavier-uniform linears and patch projection, N(0, 0.02^2) class table and
    timestep MLP, zero adaLN modulation everywhere and a zero final projection (adaLN-Zero)."""
    keys = prandom.named_keys(key, "patch", "t_mlp", "classes", "mixer", "blocks", "final")
    final_keys = prandom.named_keys(keys["final"], "adaln", "proj")
    d, p = config.d_model, config.patch_size
    params = {
        "patch": linear.init(keys["patch"], p * p * config.in_channels, d, w_init=initializers.xavier_uniform()),
        "t_mlp": mlp.init(keys["t_mlp"], config.freq_dim, d, d, w_init=initializers.normal(0.02)),
        "classes": embedding.init(keys["classes"], config.n_classes + 1, d, w_init=initializers.normal(0.02)),
        "blocks": stack.init(keys["blocks"], config.n_layer, lambda k: block_init(k, config, moe=config.n_experts > 0)),
        "final": {
            "adaln": linear.init(final_keys["adaln"], d, 2 * d, w_init=initializers.zeros),
            "proj": linear.init(final_keys["proj"], d, p * p * config.out_channels, w_init=initializers.zeros),
        },
    }
    if config.n_mixer:
        params["mixer"] = stack.init(keys["mixer"], config.n_mixer, lambda k: block_init(k, config))
    return params


def condition(params: Params, t: Real[ArrayLike, " batch"], y: Integer[ArrayLike, " batch"], config: DiTConfig) -> Float[Array, "batch d_model"]:
    """c = mlp(sinusoidal(time_scale * t)) + class_table[y]; y == n_classes is the null class."""
    freqs = timestep_embedding(config.time_scale * jnp.asarray(t), config.freq_dim, max_period=config.max_period,
                               freq_shift=config.freq_shift)  # fmt: skip
    dtype = params["t_mlp"]["fc"]["w"].dtype
    t_emb = mlp.apply(params["t_mlp"], freqs.astype(dtype), activation=activations.silu)
    return t_emb + embedding.apply(params["classes"], y)


def final_layer(params: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"]) -> Float[Array, "batch seq patch_dim"]:
    """modulate(norm(x), shift, scale) with (shift, scale) regressed from c, then the linear to patch pixels."""
    shift, scale = jnp.split(linear.apply(params["adaln"], jax.nn.silu(c)), 2, axis=-1)
    return linear.apply(params["proj"], modulate(norm(x), shift, scale))


def embed(params: Params, x: Float[Array, "batch height width channels"], config: DiTConfig) -> Float[Array, "batch seq d_model"]:
    """Patches, projected, plus the fixed positions."""
    tokens = linear.apply(params["patch"], patchify(x, config.patch_size))
    return tokens + sincos_2d(config.d_model, config.grid).astype(tokens.dtype)


def mixed_tokens(
    params: Params,
    x: Float[ArrayLike, "batch height width channels"],
    t: Real[ArrayLike, " batch"],
    y: Integer[ArrayLike, " batch"],
    config: DiTConfig,
) -> tuple[Float[Array, "batch seq d_model"], Float[Array, "batch d_model"]]:
    """The inputs checked, embedded and (with a patch-mixer) mixed over all tokens; and the condition c."""
    x, t, y = _check_inputs(params, x, t, y, config)
    c = condition(params, t, y, config)
    tokens = embed(params, x, config)
    if config.n_mixer:
        tokens = run_blocks(params["mixer"], tokens, c, config)
    return tokens, c


def apply(
    params: Params,
    x: Float[ArrayLike, "batch height width channels"],
    t: Real[ArrayLike, " batch"],
    y: Integer[ArrayLike, " batch"],
    config: DiTConfig,
) -> Float[Array, "batch height width out_channels"]:
    """The model's output for noisy input `x` at times `t` with labels `y` (n_classes: unconditional):
    DiT's forward, every token through every block."""
    tokens, c = mixed_tokens(params, x, t, y, config)
    tokens = run_blocks(params["blocks"], tokens, c, config)
    return unpatchify(final_layer(params["final"], tokens, c), config.patch_size, config.out_channels)


def apply_masked(
    params: Params,
    x: Float[ArrayLike, "batch height width channels"],
    t: Real[ArrayLike, " batch"],
    y: Integer[ArrayLike, " batch"],
    config: DiTConfig,
    *,
    key: PRNGKeyArray,
    mask_ratio: float,
) -> tuple[Float[Array, "batch height width out_channels"], Bool[Array, "batch height width 1"]]:
    """MicroDiT's deferred masking: the patch-mixer sees every token, then each sample keeps a random
    seq - round(mask_ratio * seq) of them (drawn with `key`) for the backbone and the final layer.

    Returns the output with zeros on the dropped patches, and `kept`, True on the pixels of the kept
    patches: the loss belongs on those only. mask_ratio 0 is `apply` (every pixel kept)."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"dit.apply_masked: mask_ratio must be in [0, 1), got {mask_ratio}")
    seq = config.seq
    if (n_keep := seq - round(mask_ratio * seq)) < 1:
        raise ValueError(f"dit.apply_masked: mask_ratio={mask_ratio} of {seq} patches keeps none of them "
                         f"(the loss would be 0); use at most {(seq - 0.5) / seq:.3f}")  # fmt: skip
    tokens, c = mixed_tokens(params, x, t, y, config)
    batch = tokens.shape[0]
    ids = keep_ids(key, batch, seq, n_keep)
    tokens = jnp.take_along_axis(tokens, ids[..., None], axis=1)
    out = final_layer(params["final"], run_blocks(params["blocks"], tokens, c, config), c)
    rows = jnp.arange(batch)[:, None]
    full = jnp.zeros((batch, seq, out.shape[-1]), out.dtype).at[rows, ids].set(out)
    kept = jnp.zeros((batch, seq, config.patch_size**2), bool).at[rows, ids].set(True)
    return unpatchify(full, config.patch_size, config.out_channels), unpatchify(kept, config.patch_size, 1)


def keep_ids(key: PRNGKeyArray, batch: int, seq: int, n_keep: int) -> Int[Array, "batch n_keep"]:
    """For each sample, n_keep distinct token indices drawn uniformly, in increasing order."""
    order = jnp.argsort(jax.random.uniform(key, (batch, seq)), axis=1)
    return jnp.sort(order[:, :n_keep], axis=1)


def velocity(params: Params, z: Float[Array, "batch height width channels"], t: Float[Array, " batch"], y: Integer[Array, " batch"], config: DiTConfig) -> Float[Array, "batch height width channels"]:
    """The first in_channels output channels: the prediction (a velocity for flow matching; with learned
    sigma the rest is the variance, which a flow sampler does not use)."""
    return apply(params, z, t, y, config)[..., : config.in_channels]


# ---------------------------------------------------------------- checks


def _check_inputs(params: Params, x: Any, t: Any, y: Any, config: DiTConfig) -> tuple[Array, Array, Array]:
    """Trace-time checks (free under jit) that name what does not fit: the image, t, y, the params."""
    required = ("patch", "t_mlp", "classes", "blocks", "final") + (("mixer",) if config.n_mixer else ())
    check_keys(params, "dit", required=required)
    x, t, y = jnp.asarray(x), jnp.asarray(t), jnp.asarray(y)
    want = (config.input_size, config.input_size, config.in_channels)
    if x.ndim != 4 or x.shape[1:] != want:
        raise ValueError(f"dit: x has shape {x.shape}, expected (batch, {', '.join(map(str, want))}) "
                         f"(NHWC) for {config}")  # fmt: skip
    for name, a in (("t", t), ("y", y)):
        if a.shape != (x.shape[0],):
            raise ValueError(f"dit: {name} has shape {a.shape}, expected ({x.shape[0]},): one per image")
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(f"dit: y must hold integer class ids (n_classes={config.n_classes} is the null class), got {y.dtype}")
    mixer = stack.depth(params["mixer"], "params['mixer']") if config.n_mixer else 0
    got = tuple(params["patch"]["w"].shape), stack.depth(params["blocks"], "params['blocks']"), mixer
    expected = (config.patch_size**2 * config.in_channels, config.d_model), config.n_layer, config.n_mixer
    if got != expected:
        raise ValueError(f"dit: params have a patch projection of shape {got[0]}, {got[1]} blocks and {got[2]} mixer "
                         f"blocks, but {config} needs {expected[0]}, {expected[1]} and {expected[2]}; were the params "
                         f"made with another config?")  # fmt: skip
    return x, t, y
