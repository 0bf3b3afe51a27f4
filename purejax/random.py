"""Deriving keys by name, so that adding a layer never changes the initialisation of the others.

`jax.random.split(key, n)` hands out keys by position: insert a layer and every later layer gets a new key.
Folding in a fixed number derived from the layer's *name* instead gives each named part a key of its own
that does not depend on what else exists:

    keys = named_keys(key, "wte", "wpe", "blocks", "ln_f")
    params = {"wte": embedding.init(keys["wte"], ...), ...}

The number folded in is the low 31 bits of the CRC-32 of the UTF-8 name (stable across Python runs and
versions, unlike `hash`; 31 bits keep it a non-negative int32).
Repeated identical blocks get `jax.random.fold_in(key, index)` (see `purejax.nn.stack`).

No key, no keys: `named_keys(None, "attn", "mlp")` is `{"attn": None, "mlp": None}`. An `apply` that draws only
in training (dropout) gets `key=None` in evaluation, so a block hands its sublayers their keys the same way in
both, without a branch (docs/design.md, the layer contract's "one calling style in a block").
"""

import zlib

import jax
from jaxtyping import PRNGKeyArray


def name_to_int(name: str) -> int:
    """The 31-bit integer folded in for `name`: CRC-32 of its UTF-8 bytes."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def fold_in_name(key: PRNGKeyArray, name: str) -> PRNGKeyArray:
    """A key for the part called `name`, independent of every other name."""
    return jax.random.fold_in(key, name_to_int(name))


def named_keys(key: PRNGKeyArray | None, *names: str) -> dict[str, PRNGKeyArray | None]:
    """`{name: fold_in_name(key, name)}` for each name, or `{name: None}` when `key` is None (evaluation: no
    sublayer draws); names must be distinct."""
    if len(set(names)) != len(names):
        raise ValueError(f"named_keys got repeated names: {sorted(n for n in names if names.count(n) > 1)}")
    return {name: None if key is None else fold_in_name(key, name) for name in names}
