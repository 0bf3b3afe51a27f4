"""A weight table between a Hugging Face checkpoint and our params: the machinery gpt_hf and llama_hf share.

A model's table has one row per param of ours: the Hugging Face name or names it is made of, with `{i}`
standing for a layer index, our dotted param path, and the `Transform` between the two layouts:

    TABLE = (
        (("model.embed_tokens.weight",), "embed.w", SAME),
        (("model.layers.{i}.mlp.down_proj.weight",), "blocks.mlp.down.w", LINEAR),
        ((q_proj, k_proj, v_proj), "blocks.attn.qkv.w", QKV),     # three tensors of theirs, one of ours
    )

Rows with `{i}` stack the n_layer per-layer tensors on the leading axis of our stacked blocks before the
transform runs (and the transform's output is split per layer on export), so a transform sees every layer at
once and must work on any leading axes. Reading the table both ways is all there is to import and export:
`to_tensors` walks it from our side, `from_tensors` from theirs, and `expected_shapes` runs `to_tensors` under
`jax.eval_shape`, so the list of tensors a file must hold is derived from the same rows and cannot drift.
"""

import json
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from purejax import safetensors
from purejax import tree as tree_lib

Params = dict[str, Any]
Config = TypeVar("Config")  # the model's config (GPTConfig, LlamaConfig), passed through to the transforms


class Transform(NamedTuple):
    """Inverse functions between a row's Hugging Face tensors (a list, one per name) and our array. Both take
    the model's config second. `to_hf` uses only array methods and slicing, so `jax.eval_shape` can run it."""

    from_hf: Callable[[list[np.ndarray], Any], np.ndarray]
    to_hf: Callable[[Any, Any], list[Any]]


def _transposed(x: Any) -> Any:
    return x.swapaxes(-1, -2)


SAME = Transform(lambda parts, config: parts[0], lambda x, config: [x])
# torch's nn.Linear stores (out, in); purejax.nn.linear stores (in, out). Any leading (layer) axes.
LINEAR = Transform(lambda parts, config: _transposed(parts[0]), lambda x, config: [_transposed(x)])

Row = tuple[tuple[str, ...], str, Transform]


def to_tensors(table: Sequence[Row], flat: Mapping[str, Any], config: Config, n_layer: int) -> dict[str, Any]:
    """Hugging Face tensors by name from our params as `{dotted path: array}` (`tree.flatten`)."""
    out = {}
    for names, path, transform in table:
        for name, part in zip(names, transform.to_hf(flat[path], config), strict=True):
            if "{i}" in name:
                out.update({name.format(i=i): part[i] for i in range(n_layer)})
            else:
                out[name] = part
    return out


def expected_shapes(table: Sequence[Row], shapes: Params, config: Config, n_layer: int) -> dict[str, Any]:
    """Every tensor a file must hold, by Hugging Face name, as ShapeDtypeStructs: `to_tensors` on the shapes of
    our params (`shapes`, e.g. `jax.eval_shape` of the model's init), so nothing is allocated."""
    flat = tree_lib.flatten(shapes)
    return jax.eval_shape(partial(to_tensors, table, config=config, n_layer=n_layer), flat)


def from_tensors(
    table: Sequence[Row], tensors: Mapping[str, Any], config: Config, n_layer: int, convert: Callable[[Any], Any]
) -> Params:
    """Our params from Hugging Face tensors already checked against `expected_shapes` (`tree.assert_like`): each row's
    tensors (stacked over the layers for `{i}` rows) through its transform, then `convert` (a cast, say)."""

    def gather(name: str) -> np.ndarray:
        if "{i}" in name:
            return np.stack([np.asarray(tensors[name.format(i=i)]) for i in range(n_layer)])
        return np.asarray(tensors[name])

    flat = {path: convert(transform.from_hf([gather(n) for n in names], config)) for names, path, transform in table}
    return tree_lib.unflatten(flat)


def read_config(directory: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(config.json's contents, its path for error messages) of a Hugging Face model directory, read before
    the weights so that an unsupported config fails before gigabytes are read."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a Hugging Face model directory has a config.json")
    return json.loads(config_file.read_text()), str(config_file)


def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face directory's model.safetensors, or of the shards its index lists; a
    directory with only a pickled pytorch_model.bin gets an error saying how to convert it (never unpickled)."""
    convert = "transformers (model.save_pretrained(dir, safe_serialization=True))"
    return safetensors.load_pretrained(
        directory, "model.safetensors", pickle_file="pytorch_model.bin", how_to_convert=convert
    )
