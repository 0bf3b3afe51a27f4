"""DiT weights from and to diffusers' layout (`DiTTransformer2DModel`), without torch.

    params, config = dit_diffusers.load("DiT-XL-2-256")    # a pipeline directory, or its transformer/ folder
    dit_diffusers.save(params, config, "export")           # DiTTransformer2DModel.from_pretrained("export") reads it

The mapping is the table `TABLE` below, in models/weight_table.py's format, which every converter shares:
one row per array of ours, with the diffusers name or names (`{i}` standing for a block index), our dotted
param path, and the transform between the two. Rows with `{i}` gather the n_layer per-block tensors into one
array stacked on the leading axis of params["blocks"] (and split it on export). The transforms are the layout
differences:

    LINEAR       torch's nn.Linear stores (out, in); purejax.nn.linear stores (in, out): a transpose
    PATCH        the patch embedding is a stride-p Conv2d, (d_model, C, p, p); ours is a linear on patches
                 flattened in (row, column, channel) order, (p*p*C, d_model)
    QKV_LINEAR,  separate to_q, to_k, to_v; ours is one fused qkv whose columns are grouped per head
    QKV_BIAS     (purejax.nn.attention's layout, `qkv_permutation`)
    SAME         the same array (biases, the class table)

The config.json side (which settings map to which DiTConfig fields) is models/dit_diffusers_config.py.

The rest of diffusers' DiT is DiT's maths with three settings of its own, all expressible in `DiTConfig`:
the timestep features use `downscale_freq_shift=1` (`freq_shift=1`), the LayerNorm before each MLP takes
its epsilon from the config's `norm_eps` (`mlp_norm_eps`; the others keep 1e-6), and learned sigma is
`out_channels = 2 * in_channels`. One thing is not: diffusers keeps a timestep and class embedder inside
every block (`transformer_blocks.{i}.norm1.emb`, the rows `CONDITIONING`, each `copied_per_layer`) and its
final layer reads block 0's, while DiT has one. Checkpoints converted from DiT hold identical copies, which
load; a file whose copies differ (trained in diffusers) is refused, naming the tensors that differ. Every
other mismatch (missing, unexpected or misshapen tensors, unsupported config settings) is reported all at
once, by diffusers' name.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from models import dit, weight_table
from models.dit_diffusers_config import check_representable, config_from_diffusers, config_to_diffusers
from models.dit_embeddings import sincos_2d
from models.weight_table import LINEAR, PATCH, QKV_BIAS, QKV_LINEAR, SAME, Row, copied_per_layer
from purejax import safetensors
from purejax import tree as tree_lib

ATTN = "transformer_blocks.{i}.attn1."
WEIGHTS: tuple[Row, ...] = (
    # (diffusers names, purejax path, transform)
    (("pos_embed.proj.weight",), "patch.w", PATCH),
    (("pos_embed.proj.bias",), "patch.b", SAME),
    (("transformer_blocks.{i}.norm1.linear.weight",), "blocks.adaln.w", LINEAR),  # DiT's order of the six
    (("transformer_blocks.{i}.norm1.linear.bias",), "blocks.adaln.b", SAME),
    ((ATTN + "to_q.weight", ATTN + "to_k.weight", ATTN + "to_v.weight"), "blocks.attn.qkv.w", QKV_LINEAR),
    ((ATTN + "to_q.bias", ATTN + "to_k.bias", ATTN + "to_v.bias"), "blocks.attn.qkv.b", QKV_BIAS),
    ((ATTN + "to_out.0.weight",), "blocks.attn.proj.w", LINEAR),
    ((ATTN + "to_out.0.bias",), "blocks.attn.proj.b", SAME),
    (("transformer_blocks.{i}.ff.net.0.proj.weight",), "blocks.mlp.fc.w", LINEAR),  # GELU(approximate="tanh")
    (("transformer_blocks.{i}.ff.net.0.proj.bias",), "blocks.mlp.fc.b", SAME),
    (("transformer_blocks.{i}.ff.net.2.weight",), "blocks.mlp.proj.w", LINEAR),
    (("transformer_blocks.{i}.ff.net.2.bias",), "blocks.mlp.proj.b", SAME),
    (("proj_out_1.weight",), "final.adaln.w", LINEAR),  # (shift, scale), as DiT's final layer
    (("proj_out_1.bias",), "final.adaln.b", SAME),
    (("proj_out_2.weight",), "final.proj.w", LINEAR),
    (("proj_out_2.bias",), "final.proj.b", SAME),
)
EMB = "transformer_blocks.{i}.norm1.emb."
CONDITIONING: tuple[Row, ...] = (
    # (diffusers name, one copy per block; purejax path, one for the model; transform): block 0's copy is
    # read, the one diffusers' final layer reads, and the copies are checked equal (`_check_copies`)
    ((EMB + "timestep_embedder.linear_1.weight",), "t_mlp.fc.w", copied_per_layer(LINEAR)),
    ((EMB + "timestep_embedder.linear_1.bias",), "t_mlp.fc.b", copied_per_layer(SAME)),
    ((EMB + "timestep_embedder.linear_2.weight",), "t_mlp.proj.w", copied_per_layer(LINEAR)),
    ((EMB + "timestep_embedder.linear_2.bias",), "t_mlp.proj.b", copied_per_layer(SAME)),
    ((EMB + "class_embedder.embedding_table.weight",), "classes.w", copied_per_layer(SAME)),  # last row: null
)
TABLE = WEIGHTS + CONDITIONING
POSITIONS = "pos_embed.pos_embed"  # the fixed sin-cos table, (1, seq, d_model), in files that saved the buffer
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # or shards listed in WEIGHTS_FILE + ".index.json"


def table(config: dit.DiTConfig) -> tuple[Row, ...]:
    """The rows for `config`: `TABLE`, whatever the sizes."""
    return TABLE


# ---------------------------------------------------------------- tensors


def expected_shapes(config: dit.DiTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every tensor a diffusers DiT file for `config` holds, by name, with its shape (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: dit.init(jax.random.key(0), config))
    return weight_table.expected_shapes(table(config), shapes, config, n_layer=config.n_layer)


def from_diffusers(
    tensors: Mapping[str, Any], config: dit.DiTConfig, *, dtype: Any = jnp.float32, source: str = "the tensors"
) -> dit.Params:
    """Our params from a diffusers DiT state dict ({name: array}), cast to `dtype` (None keeps the file's).
    Raises TreeMismatchError naming every missing, unexpected and misshapen tensor, and ValueError when the
    per-block embedders differ or a saved position table is not DiT's; `source` names the tensors' origin."""
    check_representable(config, source)
    tensors = dict(tensors)
    positions = tensors.pop(POSITIONS, None)
    sizes = f"n_layer={config.n_layer}, d_model={config.d_model}, n_classes={config.n_classes}"
    what = f"{source} (diffusers DiT with {sizes})"
    tree_lib.assert_like(tensors, expected_shapes(config), what, check_dtype=False)
    _check_positions(positions, config, source)
    _check_copies(tensors, config, source)
    convert = weight_table.cast_to(dtype)
    return weight_table.from_tensors(table(config), tensors, config, n_layer=config.n_layer, convert=convert)


def to_diffusers(params: dit.Params, config: dit.DiTConfig) -> dict[str, np.ndarray]:
    """A diffusers DiT state dict from our params: the inverse of `from_diffusers`, the embedders written
    once per block as diffusers keeps them."""
    check_representable(config, "dit_diffusers.to_diffusers")
    expected = jax.eval_shape(lambda: dit.init(jax.random.key(0), config))
    tree_lib.assert_like(params, expected, "params", check_dtype=False)
    flat = {path: np.asarray(x) for path, x in tree_lib.flatten(params).items()}
    return weight_table.to_tensors(table(config), flat, config, n_layer=config.n_layer)


def _check_positions(positions: Any, config: dit.DiTConfig, source: str) -> None:
    """A saved `pos_embed.pos_embed` buffer must be the fixed table this model adds (float32 rounding apart)."""
    if positions is None:
        return
    want = np.asarray(sincos_2d(config.d_model, config.grid))[None]
    positions = np.asarray(positions, np.float32)
    if positions.shape != want.shape or not np.allclose(positions, want, atol=1e-4):
        raise ValueError(
            f"{source}: {POSITIONS} of shape {positions.shape} is not DiT's fixed 2-D sin-cos table "
            f"{want.shape}: the file was saved with other positions (pos_embed_max_size or an "
            f"interpolation_scale), which this model does not support"
        )


def _check_copies(tensors: Mapping[str, Any], config: dit.DiTConfig, source: str) -> None:
    """diffusers' per-block timestep and class embedders must be one embedder written n_layer times."""
    differing = []
    for (name,), _, _ in CONDITIONING:
        first = np.asarray(tensors[name.format(i=0)])
        for i in range(1, config.n_layer):
            other = np.asarray(tensors[name.format(i=i)])
            if other.dtype != first.dtype or not np.array_equal(other, first, equal_nan=True):
                gap = np.max(np.abs(other.astype(np.float64) - first.astype(np.float64)))
                differing.append(f"{name.format(i=i)}: max |difference| from block 0's copy {gap:.3g}")
    if differing:
        raise ValueError(
            f"{source}: diffusers keeps a timestep and class embedder in every block ({EMB}...); DiT has one, "
            f"which every block and the final layer share, so the copies must be identical, as in checkpoints "
            f"converted from DiT. In this file they differ (trained in diffusers, with per-block conditioning, "
            f"which this model cannot express):\n  " + "\n  ".join(differing)
        )


# ---------------------------------------------------------------- directories


def load(
    directory: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    time_scale: float = 1.0,
    layers: Literal["scan", "loop"] = "scan",
) -> tuple[dit.Params, dit.DiTConfig]:
    """(params, config) from a diffusers DiT directory: config.json and diffusion_pytorch_model.safetensors
    (or shards listed in its .index.json), or a pipeline directory holding one in transformer/. Nothing is
    downloaded and no pickle is read. `time_scale` and `layers` are set on the config (see
    `config_from_diffusers`)."""
    directory = Path(directory)
    if (directory / "model_index.json").is_file() and (directory / "transformer").is_dir():
        directory = directory / "transformer"  # a whole pipeline (transformer, vae, scheduler)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a diffusers model directory has a config.json")
    hf = json.loads(config_file.read_text())
    config = config_from_diffusers(hf, str(config_file), time_scale=time_scale, layers=layers)
    convert = "diffusers (model.save_pretrained(dir, safe_serialization=True))"
    tensors = safetensors.load_pretrained(
        directory, WEIGHTS_FILE, pickle_file="diffusion_pytorch_model.bin", how_to_convert=convert
    )
    return from_diffusers(tensors, config, dtype=dtype, source=str(directory)), config


def save(params: dit.Params, config: dit.DiTConfig, directory: str | os.PathLike) -> None:
    """Write config.json and diffusion_pytorch_model.safetensors as diffusers saves a DiTTransformer2DModel,
    so `DiTTransformer2DModel.from_pretrained(directory)` and `load` read it."""
    tensors = to_diffusers(params, config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_diffusers(config), indent=2) + "\n")
    safetensors.save(directory / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
