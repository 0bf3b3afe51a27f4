"""Deriving keys by name, so that adding a layer never changes the initialisation of the others.

`jax.random.split(key, n)` hands out keys by position: insert a layer and every later layer gets a new key.
Folding in a fixed number derived from the layer's *name* instead gives each named part a key of its own
that does not depend on what else exists:

    keys = named_keys(key, "wte", "wpe", "blocks", "ln_f")
    params = {"wte": embedding.init(keys["wte"], ...), ...}

The number folded in is the low 31 bits of the CRC-32 of the UTF-8 name (stable across Python runs and
versions, unlike `hash`; 31 bits keep it a non-negative int32).
Repeated identical blocks get `jax.random.fold_in(key, index)` (see `purejax.nn.stack`).
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


def named_keys(key: PRNGKeyArray, *names: str) -> dict[str, PRNGKeyArray]:
    """`{name: fold_in_name(key, name)}` for each name; names must be distinct."""
    if len(set(names)) != len(names):
        raise ValueError(f"named_keys got repeated names: {sorted(n for n in names if names.count(n) > 1)}")
    return {name: fold_in_name(key, name) for name in names}
