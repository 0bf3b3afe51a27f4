"""A weight table: how another library's checkpoint maps to our params, the one format every converter uses.

A converter (gpt_hf, llama_hf, dit_diffusers, mobilenet_torch) is a table with one row per array of ours: the
names of the tensors it is made of in the other library, our dotted param path, and the `Transform` between
the two layouts:

    WEIGHTS = (
        (("model.embed_tokens.weight",), "embed.w", SAME),
        (("model.layers.{i}.mlp.down_proj.weight",), "blocks.mlp.down.w", LINEAR),
        ((q_proj, k_proj, v_proj), "blocks.attn.qkv.w", QKV_LINEAR),   # three tensors of theirs, one of ours
    )

`{i}` in a name stands for a layer index. Such a row stacks the n_layer per-layer tensors on the leading axis
of our stacked blocks before the transform runs (and splits the transform's output per layer on export), so
a transform sees every layer at once and works on any leading axes.

Reading the table both ways is all there is to import and export: `to_tensors` walks it from our side,
`from_tensors` from theirs, and `expected_shapes` runs `to_tensors` under `jax.eval_shape`, so the list of
tensors a file must hold is derived from the same rows and cannot drift. That is why a transform's
`to_theirs` uses only array methods and slicing, which numpy arrays and traced jax arrays share.
"""

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax import tree as tree_lib
from purejax.nn import attention

Params = dict[str, Any]


class Transform(NamedTuple):
    """Inverse functions between a row's tensors in the other library (a list, one per name) and our array.
    Both take the model's config second; `name` says what the transform does, for tables printed in the docs."""

    name: str
    to_ours: Callable[[list[np.ndarray], Any], np.ndarray]
    to_theirs: Callable[[Any, Any], list[Any]]


Row = tuple[tuple[str, ...], str, Transform]  # (their names, our dotted path, transform)


def _transposed(x: Any) -> Any:
    return x.swapaxes(-1, -2)


SAME = Transform("same", lambda parts, config: parts[0], lambda x, config: [x])
# torch's nn.Linear stores (out, in); purejax.nn.linear stores (in, out). Any leading (layer) axes.
LINEAR = Transform("transpose", lambda parts, config: _transposed(parts[0]), lambda x, config: [_transposed(x)])
# torch's Conv2d stores (out, in, height, width); purejax.nn.conv stores (height, width, in, out).
CONV = Transform(
    "OIHW to HWIO", lambda parts, config: parts[0].transpose(2, 3, 1, 0), lambda x, config: [x.transpose(3, 2, 0, 1)]
)


def _patch_to_ours(parts: list[np.ndarray], config: Any) -> np.ndarray:
    """A stride-p Conv2d (d_model, C, p, p) -> a linear (p*p*C, d_model) on patches flattened in (row, column,
    channel) order: CONV's layout with its first three axes flattened."""
    kernel = CONV.to_ours(parts, config)
    return kernel.reshape(-1, kernel.shape[-1])


def _patch_to_theirs(x: Any, config: Any) -> list[Any]:
    p, channels = config.patch_size, config.in_channels
    return CONV.to_theirs(x.reshape(p, p, channels, x.shape[-1]), config)


# A patch embedding (ViT's, DiT's); reads config.patch_size and config.in_channels.
PATCH = Transform("conv as linear on patches", _patch_to_ours, _patch_to_theirs)


def _qkv_to_ours(parts: list[np.ndarray], config: Any, *, linear: bool) -> np.ndarray:
    """[all q | all k | all v] columns (one fused tensor, or q, k and v side by side) -> purejax.nn.attention's
    layout, whose columns are grouped per key/value head so that tensor parallelism can split them."""
    columns = [_transposed(x) if linear else x for x in parts]
    split = columns[0] if len(columns) == 1 else np.concatenate(columns, axis=-1)
    return split[..., attention.qkv_permutation(config.attention)]


def _qkv_to_theirs(x: Any, config: Any, *, separate: bool, linear: bool) -> list[Any]:
    heads = config.attention
    split = x[..., np.argsort(attention.qkv_permutation(heads))]
    if not separate:
        return [split]
    q, kv = heads.n_head * heads.head_dim, heads.n_kv_head * heads.head_dim
    parts = [split[..., :q], split[..., q : q + kv], split[..., q + kv :]]
    return [_transposed(part) if linear else part for part in parts]


# Our fused qkv (weight or bias) from their q, k and v; all read the model's config.attention.
QKV = Transform(  # one tensor of [q | k | v] columns, in (in, out) layout (GPT-2's Conv1D c_attn)
    "qkv columns grouped per head",
    partial(_qkv_to_ours, linear=False),
    partial(_qkv_to_theirs, separate=False, linear=False),
)
QKV_LINEAR = Transform(  # three nn.Linear weights, q_proj, k_proj and v_proj, each (out, in)
    "q, k, v transposed, grouped per head",
    partial(_qkv_to_ours, linear=True),
    partial(_qkv_to_theirs, separate=True, linear=True),
)
QKV_BIAS = Transform(  # three biases
    "q, k, v grouped per head",
    partial(_qkv_to_ours, linear=False),
    partial(_qkv_to_theirs, separate=True, linear=False),
)


def copied_per_layer(transform: Transform) -> Transform:
    """For one array of ours that the other library keeps a copy of in every layer (names with `{i}`, as
    diffusers' DiT keeps its embedders): layer 0's copy is read, and config.n_layer copies are written.
    Whether the copies agree is for the converter to check."""

    def to_ours(parts: list[np.ndarray], config: Any) -> np.ndarray:
        return transform.to_ours([x[0] for x in parts], config)

    def to_theirs(x: Any, config: Any) -> list[Any]:
        return [part[None].repeat(config.n_layer, axis=0) for part in transform.to_theirs(x, config)]

    return Transform(f"{transform.name}, copied per layer", to_ours, to_theirs)


def to_tensors(table: Sequence[Row], flat: Mapping[str, Any], config: Any, *, n_layer: int) -> dict[str, Any]:
    """The other library's tensors by name from our arrays as `{dotted path: array}` (`tree.flatten`)."""
    out = {}
    for names, path, transform in table:
        for name, part in zip(names, transform.to_theirs(flat[path], config), strict=True):
            if "{i}" in name:
                out.update({name.format(i=i): part[i] for i in range(n_layer)})
            else:
                out[name] = part
    return out


def expected_shapes(table: Sequence[Row], shapes: Params, config: Any, *, n_layer: int) -> dict[str, Any]:
    """Every tensor a file must hold, by the other library's name, as ShapeDtypeStructs: `to_tensors` on the
    shapes of our params (`shapes`, e.g. `jax.eval_shape` of the model's init), so nothing is allocated."""
    flat = tree_lib.flatten(shapes)
    return jax.eval_shape(partial(to_tensors, table, config=config, n_layer=n_layer), flat)


def cast_to(dtype: Any) -> Callable[[str, np.ndarray], Any]:
    """The `convert` of `from_tensors` that makes every array a jax array of `dtype` (None keeps the file's)."""
    return lambda path, x: jnp.asarray(x, dtype)


def from_tensors(
    table: Sequence[Row],
    tensors: Mapping[str, Any],
    config: Any,
    *,
    n_layer: int,
    convert: Callable[[str, np.ndarray], Any],
) -> Params:
    """Our params from the other library's tensors, already checked against `expected_shapes`
    (`tree.assert_like`): each row's tensors (stacked over the layers for `{i}` names) through its transform,
    then `convert(path, array)` (a cast, say), row by row so that a large checkpoint is not held twice."""

    def gather(name: str) -> np.ndarray:
        if "{i}" in name:
            return np.stack([np.asarray(tensors[name.format(i=i)]) for i in range(n_layer)])
        return np.asarray(tensors[name])

    flat = {
        path: convert(path, transform.to_ours([gather(name) for name in names], config))
        for names, path, transform in table
    }
    return tree_lib.unflatten(flat)
