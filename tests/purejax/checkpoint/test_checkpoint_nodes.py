"""Node kinds: encode/decode keep every container kind, in jax's leaf order (purejax.tree.flatten is the reference)."""

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import tree as tree_lib
from purejax.checkpoint import nodes


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x"], meta_fields=[])
@dataclasses.dataclass
class Registered:
    """A custom pytree node: jax can flatten it, but a file could only restore it by importing this class."""

    x: object


class Pair(NamedTuple):
    first: object
    second: object


def mixed_tree():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    return {
        "params": params,
        "opt_state": optax.adamw(1e-3).init(params),  # a tuple of NamedTuples, one with no fields
        "by_layer": {10: jnp.ones(1), 2: jnp.ones(2)},  # int keys, sorted numerically by jax
        "misc": [None, (), {}, [np.float32(1), 2], Pair(first=True, second=None)],
    }


def test_leaves_come_out_in_flatten_order_with_flatten_paths():
    tree = mixed_tree()
    _, leaves = nodes.encode(tree)
    reference = tree_lib.flatten(tree)
    assert [name for name, _ in leaves] == list(reference)
    assert all(leaf is reference[name] for name, leaf in leaves)


def test_decode_rebuilds_every_node_kind():
    tree = mixed_tree()
    node, leaves = nodes.encode(tree)
    rebuilt = nodes.decode(node, len(leaves))
    assert jax.tree_util.tree_leaves(rebuilt) == list(range(len(leaves)))
    assert list(rebuilt["by_layer"]) == [2, 10]  # int keys stay ints
    assert rebuilt["misc"][:3] == [None, (), {}]
    assert isinstance(rebuilt["misc"][3], list)
    adam, *rest = rebuilt["opt_state"]
    assert type(adam).__name__ == "ScaleByAdamState" and adam._fields == ("count", "mu", "nu")
    assert [type(s).__name__ for s in rest] == [type(s).__name__ for s in tree["opt_state"][1:]]
    # Same paths as the original, and the same structure once NamedTuples are compared by name and fields.
    assert list(tree_lib.flatten(rebuilt)) == list(tree_lib.flatten(tree))
    assert type(adam).__module__ == type(tree["opt_state"][0]).__module__  # a label only; nothing is imported
    assert nodes.encode(jax.tree_util.tree_map(lambda _: np.zeros(()), rebuilt))[0] == node  # saving it again


def test_a_generic_namedtuple_class_is_shared_between_decodes():
    node, leaves = nodes.encode({"p": Pair(jnp.ones(1), jnp.ones(1))})
    a, b = nodes.decode(node, 2), nodes.decode(node, 2)
    assert type(a["p"]) is type(b["p"])
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"a": collections.OrderedDict(x=jnp.ones(1))}, r"^a is a collections.OrderedDict"),
        ({"a": ["text"]}, r"^a.0 is a builtins.str"),
        ({"a": {1: jnp.ones(1), "b": jnp.ones(1)}}, r"the dict at a has keys of type int, str"),
        ({"a": {(1, 2): jnp.ones(1)}}, r"the dict at a has keys of type tuple"),
        ({"s": [Registered(jnp.ones(1))]}, r"^s.0 is a .*Registered, which a checkpoint cannot hold"),
    ],
)
def test_what_cannot_be_stored_is_named_with_its_path(tree, message):
    with pytest.raises(TypeError, match=message):
        nodes.encode(tree)


@pytest.mark.parametrize(
    "node, n, message",
    [
        ([], 0, "the root is not a map with a 'kind'"),
        ({"kind": "set", "children": []}, 0, "unknown kind 'set'"),
        ({"kind": "leaf", "index": 1}, 1, "has index 1, expected 0"),
        ({"kind": "leaf", "index": True}, 1, "has index True, expected 0"),
        ({"kind": "list", "children": [{"kind": "leaf", "index": 0}]}, 2, "has 1 leaves but the manifest lists 2"),
        ({"kind": "dict", "keys": ["a", "a"], "children": [{"kind": "none"}, {"kind": "none"}]}, 0, "distinct 'keys'"),
        ({"kind": "dict", "keys": [1.5], "children": [{"kind": "none"}]}, 0, "neither str nor int"),
        ({"kind": "namedtuple", "name": "not valid", "fields": [], "children": []}, 0, "invalid name or fields"),
        ({"kind": "namedtuple", "name": "T", "fields": [[1]], "children": [{"kind": "none"}]}, 0, "invalid name or"),
        ({"kind": "tuple", "children": [{"kind": "list"}]}, 0, "list node at 0 has no 'children' list"),
    ],
)
def test_malformed_nodes_are_rejected_with_where(node, n, message):
    with pytest.raises(ValueError, match=message):
        nodes.decode(node, n)
