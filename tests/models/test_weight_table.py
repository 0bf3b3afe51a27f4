"""models.weight_table: each transform against the layout change written out by hand, each one's inverse, and a
small table read both ways (layer rows stacked and split, `expected_shapes` from the same rows). The converters'
own tests check whole checkpoints against the other libraries' layouts."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from models import weight_table
from models.weight_table import CONV, LINEAR, PATCH, QKV, QKV_BIAS, QKV_LINEAR, SAME, copied_per_layer
from purejax import tree as tree_lib
from purejax.nn import attention

HEAD_DIM, N_HEAD, N_KV_HEAD, N_LAYER = 2, 4, 2, 3
CONFIG = SimpleNamespace(
    attention=attention.AttentionConfig(d_model=N_HEAD * HEAD_DIM, n_head=N_HEAD, n_kv_head=N_KV_HEAD, causal=True),
    n_layer=N_LAYER,
    patch_size=2,
    in_channels=3,
)
D, KV = N_HEAD * HEAD_DIM, N_KV_HEAD * HEAD_DIM
rng = np.random.default_rng(0)


def normal(*shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def grouped_columns(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """purejax.nn.attention's qkv layout built head by head: per key/value head, its query heads, k, v."""
    group = N_HEAD // N_KV_HEAD
    columns = []
    for j in range(N_KV_HEAD):
        columns += [q[..., (j * group + g) * HEAD_DIM : (j * group + g + 1) * HEAD_DIM] for g in range(group)]
        columns += [k[..., j * HEAD_DIM : (j + 1) * HEAD_DIM], v[..., j * HEAD_DIM : (j + 1) * HEAD_DIM]]
    return np.concatenate(columns, axis=-1)


def test_transforms_match_the_layouts_written_out():
    w = normal(N_LAYER, 5, 7)
    np.testing.assert_array_equal(LINEAR.to_ours([w], CONFIG), np.stack([layer.T for layer in w]))
    kernel = normal(6, 3, 2, 2)  # torch's (out, in, height, width)
    hwio = np.einsum("oihw->hwio", kernel)
    np.testing.assert_array_equal(CONV.to_ours([kernel], CONFIG), hwio)
    np.testing.assert_array_equal(PATCH.to_ours([kernel], CONFIG), hwio.reshape(2 * 2 * 3, 6))
    q, k, v = normal(N_LAYER, 5, D), normal(N_LAYER, 5, KV), normal(N_LAYER, 5, KV)
    want = grouped_columns(q, k, v)
    np.testing.assert_array_equal(QKV_BIAS.to_ours([q, k, v], CONFIG), want)
    np.testing.assert_array_equal(QKV.to_ours([np.concatenate([q, k, v], axis=-1)], CONFIG), want)
    theirs = [x.swapaxes(-1, -2) for x in (q, k, v)]  # nn.Linear's (out, in)
    np.testing.assert_array_equal(QKV_LINEAR.to_ours(theirs, CONFIG), want)


@pytest.mark.parametrize(
    "transform, shapes",
    [
        (SAME, [(N_LAYER, 5)]),
        (LINEAR, [(N_LAYER, 5, 7)]),
        (CONV, [(6, 3, 2, 2)]),
        (PATCH, [(6, 3, 2, 2)]),
        (QKV, [(N_LAYER, 5, D + 2 * KV)]),
        (QKV_BIAS, [(N_LAYER, D), (N_LAYER, KV), (N_LAYER, KV)]),
        (QKV_LINEAR, [(N_LAYER, D, 5), (N_LAYER, KV, 5), (N_LAYER, KV, 5)]),
    ],
    ids=lambda x: x.name if isinstance(x, weight_table.Transform) else None,
)
def test_every_transform_is_undone_by_its_inverse(transform, shapes):
    theirs = [normal(*shape) for shape in shapes]
    ours = transform.to_ours(theirs, CONFIG)
    for got, want in zip(transform.to_theirs(ours, CONFIG), theirs, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_table_reads_both_ways_and_gives_the_shapes_it_writes():
    table = (
        (("embed.weight",), "embed.w", SAME),
        (("layers.{i}.fc.weight",), "blocks.fc.w", LINEAR),
        (("layers.{i}.shared.weight",), "shared.w", copied_per_layer(LINEAR)),
    )
    flat = {
        "embed.w": normal(4, 2),
        "blocks.fc.w": normal(N_LAYER, 2, 5),
        "shared.w": normal(2, 3),
    }
    tensors = weight_table.to_tensors(table, flat, CONFIG, n_layer=N_LAYER)
    assert sorted(tensors) == sorted(
        ["embed.weight"] + [f"layers.{i}.{name}.weight" for i in range(N_LAYER) for name in ("fc", "shared")]
    )
    np.testing.assert_array_equal(tensors["layers.2.fc.weight"], flat["blocks.fc.w"][2].T)
    for i in range(N_LAYER):
        np.testing.assert_array_equal(tensors[f"layers.{i}.shared.weight"], flat["shared.w"].T)
    shapes = weight_table.expected_shapes(table, flat, CONFIG, n_layer=N_LAYER)
    assert {name: s.shape for name, s in shapes.items()} == {name: x.shape for name, x in tensors.items()}

    ours = weight_table.from_tensors(table, tensors, CONFIG, n_layer=N_LAYER, convert=weight_table.cast_to(None))
    jax.tree.map(np.testing.assert_array_equal, ours, tree_lib.unflatten(flat))
