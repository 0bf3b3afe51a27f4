"""GPT-2 weights from and to a Hugging Face directory (config.json + model.safetensors), without torch.

    params, config = gpt_hf.load("path/to/gpt2")          # e.g. a local copy of openai-community/gpt2
    gpt_hf.save(params, config, "path/to/export")          # loadable by transformers' GPT2LMHeadModel

The mapping between the two layouts is the table `WEIGHTS` below, in models/weight_table.py's format, which
every converter shares: one row per param of ours, with the Hugging Face names (`{i}` standing for a layer
index), our dotted param path, and the transform between the two. Rows with `{i}` gather the n_layer
per-layer tensors into one array stacked on the leading axis of params["blocks"] (and split it on export).
Hugging Face's GPT-2 uses Conv1D, which stores weights as (in, out) like purejax.nn.linear, so one transform
besides `SAME` is needed: `QKV`, a column permutation, because c_attn's columns are [all q | all k | all v]
and purejax.nn.attention's qkv groups them per head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so that tensor
parallelism can split them (see that module).

Checkpoints differ in small ways, all handled by data rather than special cases: names may carry a
`transformer.` prefix (saved from GPT2LMHeadModel) or not (GPT2Model); older files store the causal-mask
buffers attn.bias and attn.masked_bias (`IGNORED`); lm_head.weight is tied to wte, usually absent, and
checked equal to wte when present. Any mismatch is reported all at once: every missing, unexpected and
shape-mismatched tensor by its Hugging Face name.
"""

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import gpt, hf_directory, weight_table
from models.weight_table import QKV, SAME, Row
from purejax import safetensors
from purejax import tree as tree_lib

WEIGHTS: tuple[Row, ...] = (
    # (Hugging Face GPT-2 names, purejax path, transform)
    (("wte.weight",), "wte.w", SAME),
    (("wpe.weight",), "wpe.w", SAME),
    (("h.{i}.ln_1.weight",), "blocks.ln_1.scale", SAME),
    (("h.{i}.ln_1.bias",), "blocks.ln_1.bias", SAME),
    (("h.{i}.attn.c_attn.weight",), "blocks.attn.qkv.w", QKV),
    (("h.{i}.attn.c_attn.bias",), "blocks.attn.qkv.b", QKV),
    (("h.{i}.attn.c_proj.weight",), "blocks.attn.proj.w", SAME),
    (("h.{i}.attn.c_proj.bias",), "blocks.attn.proj.b", SAME),
    (("h.{i}.ln_2.weight",), "blocks.ln_2.scale", SAME),
    (("h.{i}.ln_2.bias",), "blocks.ln_2.bias", SAME),
    (("h.{i}.mlp.c_fc.weight",), "blocks.mlp.fc.w", SAME),
    (("h.{i}.mlp.c_fc.bias",), "blocks.mlp.fc.b", SAME),
    (("h.{i}.mlp.c_proj.weight",), "blocks.mlp.proj.w", SAME),
    (("h.{i}.mlp.c_proj.bias",), "blocks.mlp.proj.b", SAME),
    (("ln_f.weight",), "ln_f.scale", SAME),
    (("ln_f.bias",), "ln_f.bias", SAME),
)
IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # causal-mask buffers, not weights
TIED_HEAD = "lm_head.weight"
PREFIX = "transformer."

# config.json activation_function -> GPTConfig.gelu
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "exact"}


# ---------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> gpt.GPTConfig:
    """A GPTConfig from a GPT-2 config.json (as a dict). Settings GPT-2 supports but this model does not
    (another LayerNorm epsilon, a non-4x MLP, unscaled attention...) are all listed in one ValueError."""
    missing = [k for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd") if k not in hf]
    if missing:
        model_type = hf.get("model_type")
        raise ValueError(f"{source}: missing {missing}; is this a GPT-2 config? (its model_type: {model_type!r})")
    problems = []
    if hf.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type is {hf['model_type']!r}, not 'gpt2'")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GELU:
        problems.append(f"activation_function {activation!r} is not one of {sorted(_GELU)}")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        problems.append(f"n_inner={hf['n_inner']}, but the MLP here is 4 * n_embd = {4 * hf['n_embd']} wide")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        problems.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']}, but the LayerNorms here use 1e-5")
    for key, want in [
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ]:
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]}, only {want} is supported")
    if problems:
        raise ValueError(f"{source}: unsupported GPT-2 settings:\n  " + "\n  ".join(problems))
    return gpt.GPTConfig(
        block_size=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        dropout=0.0,
        bias=True,
        gelu=_GELU[activation],
    )


def config_to_hf(config: gpt.GPTConfig) -> dict[str, Any]:
    """The config.json of a transformers GPT2LMHeadModel with this architecture."""
    _check_exportable(config)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new" if config.gelu == "tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }


# ---------------------------------------------------------------- tensors


def table(config: gpt.GPTConfig) -> tuple[Row, ...]:
    """The rows for `config`: `WEIGHTS`, whatever the sizes (the head is always tied, the biases always there)."""
    return WEIGHTS


def expected_shapes(config: gpt.GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every tensor a GPT-2 file for `config` must hold, by Hugging Face name (no prefix), with its shape."""
    shapes = jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))
    return weight_table.expected_shapes(table(config), shapes, config, n_layer=config.n_layer)


def from_hf(
    tensors: Mapping[str, Any], config: gpt.GPTConfig, *, dtype: Any = jnp.float32, source: str = "the tensors"
) -> gpt.Params:
    """Our params from Hugging Face GPT-2 tensors ({name: array}, with or without the `transformer.` prefix),
    cast to `dtype` (None keeps the file's). Raises TreeMismatchError naming every missing, unexpected and
    shape-mismatched tensor; `source` says where the tensors came from in that message."""
    tensors = {name.removeprefix(PREFIX): value for name, value in tensors.items()}
    head = tensors.pop(TIED_HEAD, None)
    tensors = {name: value for name, value in tensors.items() if not IGNORED.fullmatch(name)}
    sizes = f"n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size={config.vocab_size}"
    what = f"{source} (GPT-2 with {sizes}, n_positions={config.block_size})"
    tree_lib.assert_like(tensors, expected_shapes(config), what, check_dtype=False)
    if head is not None and not np.array_equal(np.asarray(head), np.asarray(tensors["wte.weight"])):
        raise ValueError(
            f"{TIED_HEAD} differs from wte.weight: this model ties its output head to the token embedding, "
            f"so it cannot hold a separately trained head"
        )
    convert = weight_table.cast_to(dtype)
    return weight_table.from_tensors(table(config), tensors, config, n_layer=config.n_layer, convert=convert)


def to_hf(params: gpt.Params, config: gpt.GPTConfig, *, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """Hugging Face GPT-2 tensors from our params: the inverse of `from_hf` (no lm_head: it is tied)."""
    _check_exportable(config)
    expected = jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))
    tree_lib.assert_like(params, expected, "params", check_dtype=False)
    flat = {path: np.asarray(x) for path, x in tree_lib.flatten(params).items()}
    tensors = weight_table.to_tensors(table(config), flat, config, n_layer=config.n_layer)
    return {prefix + name: x for name, x in tensors.items()}


# ---------------------------------------------------------------- directories


def load(directory: str | os.PathLike, *, dtype: Any = jnp.float32) -> tuple[gpt.Params, gpt.GPTConfig]:
    """(params, config) from a Hugging Face GPT-2 directory: config.json and model.safetensors, or shards
    listed in model.safetensors.index.json. Nothing is downloaded and no pickle is read."""
    hf, source = hf_directory.read_config(directory)
    config = config_from_hf(hf, source=source)
    tensors = hf_directory.read_weights(directory)
    return from_hf(tensors, config, dtype=dtype, source=str(directory)), config


def save(params: gpt.Params, config: gpt.GPTConfig, directory: str | os.PathLike, *, prefix: str = PREFIX) -> None:
    """Write config.json and model.safetensors in the layout transformers' GPT2LMHeadModel saves (names
    prefixed `transformer.`, no lm_head), so `GPT2LMHeadModel.from_pretrained(directory)` and `load` read it."""
    tensors = to_hf(params, config, prefix=prefix)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    safetensors.save(directory / "model.safetensors", tensors, metadata={"format": "pt"})


def _check_exportable(config: gpt.GPTConfig) -> None:
    if not config.bias:
        raise ValueError("GPT-2 in Hugging Face's layout always has biases; a model with bias=False cannot be exported")
