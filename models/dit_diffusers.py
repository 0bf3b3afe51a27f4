"""DiT weights from and to diffusers' layout (`DiTTransformer2DModel`), without torch.

    params, config = dit_diffusers.load("DiT-XL-2-256")    # a pipeline directory, or its transformer/ folder
    dit_diffusers.save(params, config, "export")           # DiTTransformer2DModel.from_pretrained("export") reads it

The mapping is the table `WEIGHTS` below, one row per tensor of ours: the diffusers name or names, with `{i}`
standing for a block index, our dotted param path, and the transform between the two. Rows with `{i}` gather
the n_layer per-block tensors into one array stacked on the leading axis of params["blocks"] (and split it on
export). The transforms are the layout differences:

    LINEAR   torch's nn.Linear stores (out, in); purejax.nn.linear stores (in, out): a transpose
    PATCH    the patch embedding is a stride-p Conv2d, (d_model, C, p, p); ours is a linear on patches
             flattened in (row, column, channel) order, (p*p*C, d_model)
    QKV_*    separate to_q, to_k, to_v; ours is one fused qkv whose columns are grouped per head
             (purejax.nn.attention's layout, `qkv_permutation`)
    SAME     the same array (biases, the class table)

The config.json side (which settings map to which DiTConfig fields) is models/dit_diffusers_config.py.

The rest of diffusers' DiT is DiT's maths with three settings of its own, all expressible in `DiTConfig`:
the timestep features use `downscale_freq_shift=1` (`freq_shift=1`), the LayerNorm before each MLP takes
its epsilon from the config's `norm_eps` (`mlp_norm_eps`; the others keep 1e-6), and learned sigma is
`out_channels = 2 * in_channels`. One thing is not: diffusers keeps a timestep and class embedder inside
every block (`transformer_blocks.{i}.norm1.emb`, table `CONDITIONING`) and its final layer reads block 0's,
while DiT has one. Checkpoints converted from DiT hold identical copies, which load; a file whose copies
differ (trained in diffusers) is refused, naming the tensors that differ. Every other mismatch (missing,
unexpected or misshapen tensors, unsupported config settings) is reported all at once, by diffusers' name.
"""

import json
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models import dit
from models.dit_diffusers_config import check_representable, config_from_diffusers, config_to_diffusers
from models.dit_embeddings import sincos_2d
from purejax import safetensors
from purejax import tree as tree_lib
from purejax.nn import attention


class Transform(NamedTuple):
    """Inverse functions between diffusers tensors (a list, one per name of the row) and our array.
    `to_diffusers` uses only array methods and slicing, so `jax.eval_shape` can run it (`expected_shapes`)."""

    from_diffusers: Callable[[list[np.ndarray], dit.DiTConfig], np.ndarray]
    to_diffusers: Callable[[Any, dit.DiTConfig], list[Any]]


def _transposed(x: Any) -> Any:
    return x.swapaxes(-1, -2)


def patch_from(parts: list[np.ndarray], config: dit.DiTConfig) -> np.ndarray:
    """Conv2d weight (d_model, C, p, p) -> linear weight (p*p*C, d_model), rows in patchify's (row, col, C) order."""
    (w,) = parts
    return w.transpose(2, 3, 1, 0).reshape(-1, w.shape[0])


def patch_to(w: Any, config: dit.DiTConfig) -> list[Any]:
    p, c = config.patch_size, config.in_channels
    return [w.reshape(p, p, c, w.shape[-1]).transpose(3, 2, 0, 1)]


def qkv_bias_from(parts: list[np.ndarray], config: dit.DiTConfig) -> np.ndarray:
    """[q | k | v] columns (to_q, to_k, to_v side by side) -> purejax.nn.attention's per-head groups."""
    return np.concatenate(parts, axis=-1)[..., attention.qkv_permutation(config.attention)]


def qkv_bias_to(x: Any, config: dit.DiTConfig) -> list[Any]:
    d, split = config.d_model, x[..., np.argsort(attention.qkv_permutation(config.attention))]
    return [split[..., i * d : (i + 1) * d] for i in range(3)]


def qkv_weight_from(parts: list[np.ndarray], config: dit.DiTConfig) -> np.ndarray:
    return qkv_bias_from([_transposed(x) for x in parts], config)


def qkv_weight_to(x: Any, config: dit.DiTConfig) -> list[Any]:
    return [_transposed(part) for part in qkv_bias_to(x, config)]


SAME = Transform(lambda parts, config: parts[0], lambda x, config: [x])
LINEAR = Transform(lambda parts, config: _transposed(parts[0]), lambda x, config: [_transposed(x)])  # any leading axes
PATCH = Transform(patch_from, patch_to)
QKV_WEIGHT, QKV_BIAS = Transform(qkv_weight_from, qkv_weight_to), Transform(qkv_bias_from, qkv_bias_to)

ATTN = "transformer_blocks.{i}.attn1."
WEIGHTS: tuple[tuple[tuple[str, ...], str, Transform], ...] = (
    # (diffusers names, purejax path, transform)
    (("pos_embed.proj.weight",), "patch.w", PATCH),
    (("pos_embed.proj.bias",), "patch.b", SAME),
    (("transformer_blocks.{i}.norm1.linear.weight",), "blocks.adaln.w", LINEAR),  # DiT's order of the six
    (("transformer_blocks.{i}.norm1.linear.bias",), "blocks.adaln.b", SAME),
    ((ATTN + "to_q.weight", ATTN + "to_k.weight", ATTN + "to_v.weight"), "blocks.attn.qkv.w", QKV_WEIGHT),
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
CONDITIONING: tuple[tuple[str, str, Transform], ...] = (
    # (diffusers name, one copy per block; purejax path, one for the model; transform)
    (EMB + "timestep_embedder.linear_1.weight", "t_mlp.fc.w", LINEAR),
    (EMB + "timestep_embedder.linear_1.bias", "t_mlp.fc.b", SAME),
    (EMB + "timestep_embedder.linear_2.weight", "t_mlp.proj.w", LINEAR),
    (EMB + "timestep_embedder.linear_2.bias", "t_mlp.proj.b", SAME),
    (EMB + "class_embedder.embedding_table.weight", "classes.w", SAME),  # n_classes + 1 rows: the last is null
)
POSITIONS = "pos_embed.pos_embed"  # the fixed sin-cos table, (1, seq, d_model), in files that saved the buffer
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # or shards listed in WEIGHTS_FILE + ".index.json"


# ---------------------------------------------------------------- tensors


def expected_shapes(config: dit.DiTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every tensor a diffusers DiT file for `config` holds, by name, with its shape (nothing is allocated)."""
    ours = tree_lib.flatten(jax.eval_shape(partial(dit.init, config=config), jax.random.key(0)))
    return jax.eval_shape(partial(_to_diffusers, config=config), ours)


def from_diffusers(
    tensors: Mapping[str, Any], config: dit.DiTConfig, *, dtype: Any = jnp.float32, source: str = "the tensors"
) -> dit.Params:
    """Our params from a diffusers DiT state dict ({name: array}), cast to `dtype` (None keeps the file's).
    Raises TreeMismatchError naming every missing, unexpected and misshapen tensor, and ValueError when the
    per-block embedders differ or a saved position table is not DiT's; `source` names the tensors' origin."""
    check_representable(config, source)
    tensors = dict(tensors)
    positions = tensors.pop(POSITIONS, None)
    report = tree_lib.diff(tensors, expected_shapes(config), check_dtype=False)
    if not report.ok:
        sizes = f"n_layer={config.n_layer}, d_model={config.d_model}, n_classes={config.n_classes}"
        raise tree_lib.TreeMismatchError(report.format(f"{source} (diffusers DiT with {sizes})"))
    _check_positions(positions, config, source)
    _check_copies(tensors, config, source)

    def gather(name: str) -> np.ndarray:
        if "{i}" in name:
            return np.stack([np.asarray(tensors[name.format(i=i)]) for i in range(config.n_layer)])
        return np.asarray(tensors[name])

    flat = {}
    for names, path, transform in WEIGHTS:
        flat[path] = jnp.asarray(transform.from_diffusers([gather(name) for name in names], config), dtype)
    for name, path, transform in CONDITIONING:  # block 0's copy, the one diffusers' final layer reads
        flat[path] = jnp.asarray(transform.from_diffusers([np.asarray(tensors[name.format(i=0)])], config), dtype)
    return tree_lib.unflatten(flat)


def to_diffusers(params: dit.Params, config: dit.DiTConfig) -> dict[str, np.ndarray]:
    """A diffusers DiT state dict from our params: the inverse of `from_diffusers`, the embedders written
    once per block as diffusers keeps them."""
    check_representable(config, "dit_diffusers.to_diffusers")
    expected = jax.eval_shape(partial(dit.init, config=config), jax.random.key(0))
    tree_lib.assert_like(params, expected, "params", check_dtype=False)
    return _to_diffusers({path: np.asarray(x) for path, x in tree_lib.flatten(params).items()}, config)


def _to_diffusers(flat: dict[str, Any], config: dit.DiTConfig) -> dict[str, Any]:
    out = {}
    for names, path, transform in WEIGHTS:
        for name, part in zip(names, transform.to_diffusers(flat[path], config), strict=True):
            layers = range(config.n_layer) if "{i}" in name else None
            out.update({name: part} if layers is None else {name.format(i=i): part[i] for i in layers})
    for name, path, transform in CONDITIONING:
        (part,) = transform.to_diffusers(flat[path], config)
        out.update({name.format(i=i): part for i in range(config.n_layer)})
    return out


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
    for name, _, _ in CONDITIONING:
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
