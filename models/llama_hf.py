"""Llama weights from and to a Hugging Face directory (`LlamaForCausalLM`'s layout), without torch.

    params, config = llama_hf.load("path/to/Llama-3.2-1B")     # config.json + model.safetensors (or shards)
    llama_hf.save(params, config, "export", max_shard_bytes=5 * 10**9)   # LlamaForCausalLM.from_pretrained reads it

The mapping is the table `WEIGHTS`, in models/weight_table.py's format, which every converter shares: one
row per param of ours, with the Hugging Face names (`{i}` standing for a layer index), our dotted path, and
the transform.

    LINEAR      torch's nn.Linear stores (out, in); purejax.nn.linear stores (in, out): a transpose
    QKV_LINEAR  q_proj, k_proj and v_proj side by side are [all q | all k | all v] columns; ours is one fused
                qkv whose columns are grouped per key/value head, [q heads of group 0, k_0, v_0 | ...]
                (purejax.nn.attention's layout, `qkv_permutation`), so tensor parallelism can split it
    SAME        the same array (the embedding, the RMSNorm scales)

Rotary needs no transform. Hugging Face's Llama pairs feature i of each query and key head with feature
i + head_dim / 2 (`rotate_half`), and so does purejax.nn.rotary: the q_proj and k_proj rows are used in the
order the file has them. (Meta's original checkpoints pair neighbours 2i and 2i + 1; Hugging Face's
conversion script permuted their q and k rows once, when it made these files, which is why they differ from
Meta's. `rotary.half_permutation` is that permutation, for reading Meta's files.)

`lm_head.weight` is a row of its own unless the config ties it to the embedding (`tie_word_embeddings`);
a tied file that still stores it must store the embedding's copy. Mismatches are reported all at once, by
Hugging Face name: every missing, unexpected and misshapen tensor, and every unsupported config.json
setting (`config_from_hf`).
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

from models import hf_directory, llama, weight_table
from models.weight_table import LINEAR, QKV_LINEAR, SAME, Row
from purejax import safetensors
from purejax import tree as tree_lib
from purejax.nn import rotary

LAYER = "model.layers.{i}."
WEIGHTS: tuple[Row, ...] = (
    # (Hugging Face names, purejax path, transform)
    (("model.embed_tokens.weight",), "embed.w", SAME),
    ((LAYER + "input_layernorm.weight",), "blocks.attn_norm.scale", SAME),
    (tuple(LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), "blocks.attn.qkv.w", QKV_LINEAR),
    ((LAYER + "self_attn.o_proj.weight",), "blocks.attn.proj.w", LINEAR),
    ((LAYER + "post_attention_layernorm.weight",), "blocks.mlp_norm.scale", SAME),
    ((LAYER + "mlp.gate_proj.weight",), "blocks.mlp.gate.w", LINEAR),
    ((LAYER + "mlp.up_proj.weight",), "blocks.mlp.up.w", LINEAR),
    ((LAYER + "mlp.down_proj.weight",), "blocks.mlp.down.w", LINEAR),
    (("model.norm.weight",), "norm.scale", SAME),
)
HEAD: Row = (("lm_head.weight",), "head.w", LINEAR)  # a row of the table only when the head is not tied
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer older versions saved
WEIGHTS_FILE = "model.safetensors"  # or shards listed in WEIGHTS_FILE + ".index.json"


def table(config: llama.LlamaConfig) -> tuple[Row, ...]:
    """The rows for this config: `WEIGHTS`, and `HEAD` unless the head is tied to the embedding."""
    return WEIGHTS if config.tie_embeddings else (*WEIGHTS, HEAD)


# ---------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> llama.LlamaConfig:
    """A LlamaConfig from a Llama config.json (as a dict). Settings Hugging Face's Llama has but this model
    does not (biases, another activation, a head_dim other than hidden_size / num_attention_heads, another
    rope_type) are all listed in one ValueError."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(
            f"{source}: missing {missing}; is this a Llama config? (its model_type: {hf.get('model_type')!r})"
        )
    n_head = hf["num_attention_heads"]
    problems = []
    if hf.get("model_type", "llama") != "llama":
        problems.append(f"model_type is {hf['model_type']!r}, not 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r}: the MLP here is SwiGLU, hidden_act 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            problems.append(f"{key}=true: the projections here have no biases")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // n_head):
        problems.append(
            f"head_dim={hf['head_dim']}, but here head_dim = hidden_size / num_attention_heads = "
            f"{hf['hidden_size'] // n_head}"
        )
    rope = hf.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the scaling in one dict
    scaling = _scaling_from_hf(hf.get("rope_scaling") or rope, problems)
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if problems:
        raise ValueError(f"{source}: unsupported Llama settings:\n  " + "\n  ".join(problems))
    return llama.LlamaConfig(
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _scaling_from_hf(scaling: Mapping[str, Any], problems: list[str]) -> rotary.RopeScaling | None:
    """rope_scaling (or transformers 5's rope_parameters) as a purejax.nn.rotary scaling; older files say
    "type" where newer say "rope_type". Anything else is appended to `problems`."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return rotary.LinearScaling(float(scaling["factor"]))
    if kind == "llama3":
        return rotary.Llama3Scaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        )
    problems.append(f"rope_type {kind!r}: supported are 'default', 'linear' and 'llama3'")
    return None


def config_to_hf(config: llama.LlamaConfig) -> dict[str, Any]:
    """The config.json of a transformers LlamaForCausalLM with this architecture."""
    scaling = config.rope_scaling
    if isinstance(scaling, rotary.LinearScaling):
        rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
    elif isinstance(scaling, rotary.Llama3Scaling):
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    else:
        rope_scaling = None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }


# ---------------------------------------------------------------- tensors


def expected_shapes(config: llama.LlamaConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every tensor a Llama file for `config` must hold, by Hugging Face name, with its shape."""
    shapes = jax.eval_shape(lambda: llama.init(jax.random.key(0), config))
    return weight_table.expected_shapes(table(config), shapes, config, n_layer=config.n_layer)


def from_hf(
    tensors: Mapping[str, Any], config: llama.LlamaConfig, *, dtype: Any = jnp.float32, source: str = "the tensors"
) -> llama.Params:
    """Our params from Hugging Face Llama tensors ({name: array}), cast to `dtype` (None keeps the file's).
    Raises TreeMismatchError naming every missing, unexpected and misshapen tensor; `source` says where the
    tensors came from in that message."""
    tensors = {name: value for name, value in tensors.items() if not IGNORED.fullmatch(name)}
    head = tensors.pop(HEAD[0][0], None) if config.tie_embeddings else None
    sizes = f"n_layer={config.n_layer}, d_model={config.d_model}, n_head={config.n_head}, n_kv_head={config.n_kv_head}"
    what = f"{source} (Llama with {sizes}, d_ff={config.d_ff}, vocab_size={config.vocab_size})"
    tree_lib.assert_like(tensors, expected_shapes(config), what, check_dtype=False)
    if head is not None and not np.array_equal(np.asarray(head), np.asarray(tensors["model.embed_tokens.weight"])):
        raise ValueError(
            f"{source}: lm_head.weight differs from model.embed_tokens.weight, but tie_word_embeddings is true; "
            f"set it to false in config.json if the head was trained separately"
        )
    convert = weight_table.cast_to(dtype)
    return weight_table.from_tensors(table(config), tensors, config, n_layer=config.n_layer, convert=convert)


def to_hf(params: llama.Params, config: llama.LlamaConfig) -> dict[str, np.ndarray]:
    """Hugging Face Llama tensors from our params, in LlamaForCausalLM's names: the inverse of `from_hf`."""
    expected = jax.eval_shape(lambda: llama.init(jax.random.key(0), config))
    tree_lib.assert_like(params, expected, "params", check_dtype=False)
    flat = {path: np.asarray(x) for path, x in tree_lib.flatten(params).items()}
    tensors = weight_table.to_tensors(table(config), flat, config, n_layer=config.n_layer)
    return {name: np.ascontiguousarray(x) for name, x in tensors.items()}


# ---------------------------------------------------------------- directories


def load(directory: str | os.PathLike, *, dtype: Any = jnp.float32) -> tuple[llama.Params, llama.LlamaConfig]:
    """(params, config) from a Hugging Face Llama directory: config.json and model.safetensors, or the shards
    model.safetensors.index.json lists. Nothing is downloaded and no pickle is read."""
    hf, source = hf_directory.read_config(directory)
    config = config_from_hf(hf, source=source)
    tensors = hf_directory.read_weights(directory)
    return from_hf(tensors, config, dtype=dtype, source=str(directory)), config


def save(
    params: llama.Params, config: llama.LlamaConfig, directory: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Write config.json and the weights as transformers' LlamaForCausalLM saves them: model.safetensors, or
    shards of at most `max_shard_bytes` each (a tensor larger than that gets a shard of its own) with
    model.safetensors.index.json. The tensors keep the params' dtype, which config.json records."""
    tensors = to_hf(params, config)
    hf_config = config_to_hf(config) | {"torch_dtype": str(np.asarray(tensors["model.norm.weight"]).dtype)}
    safetensors.save_pretrained(directory, WEIGHTS_FILE, tensors, max_shard_bytes=max_shard_bytes)
    (Path(directory) / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
