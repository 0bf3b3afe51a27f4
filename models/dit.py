"""DiT, the diffusion transformer (Peebles & Xie 2023, arXiv:2212.09748), and MicroDiT's deferred masking
(Sehwag et al. 2024, arXiv:2407.15811), as pure functions over a dict of arrays.

    x (batch, height, width, channels), t (batch,), y (batch,) class ids, n_classes = the null class
      -> patch_embedding: patchify (batch, seq, patch*patch*channels), linear -> + fixed 2-D sin-cos positions
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

params = {"patch": patch_embedding (patch*patch*in_channels, d_model), "t_mlp": mlp (freq_dim -> d_model -> d_model),
          "classes": embedding (n_classes + 1, d_model), ["mixer": blocks,] "blocks": {"adaln", "attn", "mlp"
          (or "moe"), every leaf stacked on a leading layer axis}, "final": {"adaln", "proj"}}.
Blocks run under `lax.scan` (`purejax.nn.stack`) or, with `layers="loop"`, as a Python loop.

MicroDiT ("Stretching Each Dollar"): the patch-mixer sees every token, so information from patches that are
then dropped still reaches the kept ones; the backbone runs on the kept tokens only, which is where the
training compute is saved, and the loss is taken on the kept patches (`apply_masked` returns which pixels
they cover). With mask_ratio 0 (fine-tuning, sampling) `apply_masked` is `apply`.

Beside this page: the sizes and their checks (`dit_config`: `DiTConfig`, `preset`, both also reachable as
`dit.DiTConfig` and `dit.preset`), the parameter-free input features (`dit_embeddings`), the mixture-of-experts
MLP that `n_experts > 0` puts in the backbone (`dit_moe`), and diffusers' DiT checkpoints (`dit_diffusers`).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, Real

from models import dit_moe
from models.dit_config import NORM_EPS, DiTConfig, preset  # noqa: F401 - re-exported: dit.preset
from models.dit_embeddings import (
    patchify,  # noqa: F401 - re-exported: dit.patchify (bench/dit.py)
    sincos_2d,
    timestep_embedding,
    unpatchify,
)
from purejax import random as prandom
from purejax.nn import (
    activations,
    attention,
    check_keys,
    embedding,
    initializers,
    layer_norm,
    linear,
    mlp,
    patch_embedding,
    stack,
)
from purejax.nn import remat as remat_lib

Params = dict[str, Any]


# ---------------------------------------------------------------- blocks


def modulate(
    x: Float[Array, "batch seq d"], shift: Float[Array, "batch d"], scale: Float[Array, "batch d"]
) -> Float[Array, "batch seq d"]:
    """adaLN: x * (1 + scale) + shift, per sample (scale 0 is the identity, hence the 1 +)."""
    return x * (1 + scale[:, None]) + shift[:, None]


def norm(x: Float[Array, "batch seq d"], *, eps: float = NORM_EPS) -> Float[Array, "batch seq d"]:
    """LayerNorm without parameters (DiT's `elementwise_affine=False`): adaLN supplies scale and shift."""
    return layer_norm.apply({"scale": jnp.ones(x.shape[-1], x.dtype)}, x, eps=eps)


def block_init(key: PRNGKeyArray, config: DiTConfig, *, moe: bool = False) -> Params:
    """One adaLN-Zero block: xavier-uniform linears (DiT's `initialize_weights`), zero modulation."""
    keys = prandom.named_keys(key, "adaln", "attn", "mlp")
    d, xavier = config.d_model, initializers.xavier_uniform()
    params = {
        "adaln": linear.init(keys["adaln"], d, 6 * d, w_init=initializers.zeros()),
        "attn": attention.init(keys["attn"], config.attention, w_init=xavier),
    }
    if moe:
        params["moe"] = dit_moe.init(keys["mlp"], d, config.d_ff, config.n_experts)
    else:
        params["mlp"] = mlp.init(keys["mlp"], d, config.d_ff, w_init=xavier)
    return params


def block(
    params: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"], config: DiTConfig
) -> Float[Array, "batch seq d_model"]:
    """x + gate_msa * attn(modulate(norm(x))), then x + gate_mlp * mlp(modulate(norm(x))), DiT's order of the
    six modulation vectors."""
    mod = linear.apply(params["adaln"], jax.nn.silu(c))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
    h = modulate(norm(x), shift_msa, scale_msa)
    x = x + gate_msa[:, None] * attention.apply(params["attn"], h, config.attention)
    h = modulate(norm(x, eps=config.mlp_norm_eps), shift_mlp, scale_mlp)
    if "moe" in params:
        h = dit_moe.apply(params["moe"], h, top_k=config.top_k)
    else:
        h = mlp.apply(params["mlp"], h, activation=activations.gelu_tanh)  # DiT: GELU(approximate="tanh")
    return x + gate_mlp[:, None] * h


def run_blocks(
    blocks: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"], config: DiTConfig
) -> Float[Array, "batch seq d_model"]:
    """The stacked blocks, under scan or as a loop (`config.layers`), rematerialised as `config.remat` says."""
    step = remat_lib.wrap(lambda p, x: block(p, x, c, config), config.remat, prevent_cse=config.layers == "loop")
    if config.layers == "scan":
        return stack.scan(step, blocks, x)
    return stack.loop(step, stack.unstack(blocks), x)


# ---------------------------------------------------------------- the model


def init(key: PRNGKeyArray, config: DiTConfig) -> Params:
    """DiT's `initialize_weights`: xavier-uniform linears and patch projection, N(0, 0.02^2) class table and
    timestep MLP, zero adaLN modulation everywhere and a zero final projection (adaLN-Zero)."""
    keys = prandom.named_keys(key, "patch", "t_mlp", "classes", "mixer", "blocks", "final")
    final_keys = prandom.named_keys(keys["final"], "adaln", "proj")
    d, p, zeros, small = config.d_model, config.patch_size, initializers.zeros(), initializers.normal(0.02)
    backbone_block = lambda k: block_init(k, config, moe=config.n_experts > 0)  # noqa: E731
    params = {
        "patch": patch_embedding.init(keys["patch"], config.in_channels, d, p, w_init=initializers.xavier_uniform()),
        "t_mlp": mlp.init(keys["t_mlp"], config.freq_dim, d, d, w_init=small),
        "classes": embedding.init(keys["classes"], config.n_classes + 1, d, w_init=small),
        "blocks": stack.init(keys["blocks"], config.n_layer, backbone_block),
        "final": {
            "adaln": linear.init(final_keys["adaln"], d, 2 * d, w_init=zeros),
            "proj": linear.init(final_keys["proj"], d, p * p * config.out_channels, w_init=zeros),
        },
    }
    if config.n_mixer:
        params["mixer"] = stack.init(keys["mixer"], config.n_mixer, lambda k: block_init(k, config))
    return params


def condition(
    params: Params, t: Real[ArrayLike, " batch"], y: Integer[ArrayLike, " batch"], config: DiTConfig
) -> Float[Array, "batch d_model"]:
    """c = mlp(sinusoidal(time_scale * t)) + class_table[y]; y == n_classes is the null class."""
    freqs = timestep_embedding(
        config.time_scale * jnp.asarray(t), config.freq_dim, max_period=config.max_period, freq_shift=config.freq_shift
    )
    dtype = params["t_mlp"]["fc"]["w"].dtype
    t_emb = mlp.apply(params["t_mlp"], freqs.astype(dtype), activation=activations.silu)
    return t_emb + embedding.apply(params["classes"], y)


def embed(
    params: Params, x: Float[Array, "batch height width channels"], config: DiTConfig
) -> Float[Array, "batch seq d_model"]:
    """Patches, projected, plus the fixed positions."""
    tokens = patch_embedding.apply(params["patch"], x, patch_size=config.patch_size)
    return tokens + sincos_2d(config.d_model, config.grid).astype(tokens.dtype)


def final_layer(
    params: Params, x: Float[Array, "batch seq d_model"], c: Float[Array, "batch d_model"]
) -> Float[Array, "batch seq patch_dim"]:
    """modulate(norm(x), shift, scale) with (shift, scale) regressed from c, then the linear to patch pixels."""
    shift, scale = jnp.split(linear.apply(params["adaln"], jax.nn.silu(c)), 2, axis=-1)
    return linear.apply(params["proj"], modulate(norm(x), shift, scale))


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
    DiT's forward, every token through every block. Deterministic: DiT has no dropout, so no key."""
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
    mask_ratio: float,
    key: PRNGKeyArray,
) -> tuple[Float[Array, "batch height width out_channels"], Bool[Array, "batch height width 1"]]:
    """MicroDiT's deferred masking: the patch-mixer sees every token, then each sample keeps a random
    seq - round(mask_ratio * seq) of them (drawn with `key`) for the backbone and the final layer.

    Returns the output with zeros on the dropped patches, and `kept`, True on the pixels of the kept
    patches: the loss belongs on those only. mask_ratio 0 is `apply` (every pixel kept)."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"dit.apply_masked: mask_ratio must be in [0, 1), got {mask_ratio}")
    seq = config.seq
    if (n_keep := seq - round(mask_ratio * seq)) < 1:
        raise ValueError(
            f"dit.apply_masked: mask_ratio={mask_ratio} of {seq} patches keeps none of them "
            f"(the loss would be 0); use at most {(seq - 0.5) / seq:.3f}"
        )
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


def velocity(
    params: Params,
    z: Float[ArrayLike, "batch height width channels"],
    t: Real[ArrayLike, " batch"],
    y: Integer[ArrayLike, " batch"],
    config: DiTConfig,
) -> Float[Array, "batch height width channels"]:
    """The first in_channels output channels: the prediction (a velocity for flow matching; with learned
    sigma the rest is the variance, which a flow sampler does not use)."""
    return apply(params, z, t, y, config)[..., : config.in_channels]


def _check_inputs(params: Params, x: Any, t: Any, y: Any, config: DiTConfig) -> tuple[Array, Array, Array]:
    """Trace-time checks (free under jit) that name what does not fit: the image, t, y, the params."""
    required = ("patch", "t_mlp", "classes", "blocks", "final") + (("mixer",) if config.n_mixer else ())
    check_keys(params, "dit", required=required)
    x, t, y = jnp.asarray(x), jnp.asarray(t), jnp.asarray(y)
    want = (config.input_size, config.input_size, config.in_channels)
    if x.ndim != 4 or x.shape[1:] != want:
        raise ValueError(
            f"dit: x has shape {x.shape}, expected (batch, {', '.join(map(str, want))}) (NHWC) for {config}"
        )
    for name, a in (("t", t), ("y", y)):
        if a.shape != (x.shape[0],):
            raise ValueError(f"dit: {name} has shape {a.shape}, expected ({x.shape[0]},): one per image")
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(
            f"dit: y must hold integer class ids (n_classes={config.n_classes} is the null class), got {y.dtype}"
        )
    mixer = stack.depth(params["mixer"], "params['mixer']") if config.n_mixer else 0
    got = tuple(params["patch"]["w"].shape), stack.depth(params["blocks"], "params['blocks']"), mixer
    expected = (config.patch_size**2 * config.in_channels, config.d_model), config.n_layer, config.n_mixer
    if got != expected:
        raise ValueError(
            f"dit: params have a patch projection of shape {got[0]}, {got[1]} blocks and {got[2]} mixer "
            f"blocks, but {config} needs {expected[0]}, {expected[1]} and {expected[2]}; were the params "
            f"made with another config?"
        )
    return x, t, y
