"""A header read one msgpack value at a time, with the memory of what it decodes to charged to a budget.

msgpack is far denser than the Python objects it decodes to: `[]` is one byte and a Python list 56, `{"a": 0}`
is four bytes and a dict 184, a namedtuple class is made from a few bytes of field names and takes kilobytes.
A valid header of 60 MB of empty lists would decode to 4 GiB. So a reader never decodes a header whole: it
reads it value by value (`Stream`), and every container msgpack builds (through its `list_hook` and
`object_hook`), with the scalars in it, is charged to a `Budget` of `MAX_HEADER_EXPANSION` times the header's
bytes plus `HEADER_SLACK_BYTES`. What a reader builds from the header is charged too (the tree, the manifest,
namedtuple classes); what it builds only for a moment (a manifest entry, before it becomes a `LeafInfo`) is
paid back. A header that would cost more is refused as soon as the budget runs out, so the memory a header
costs, and the time (which follows the objects built), is at most a fixed multiple of its size. Beyond the
budget a reader holds only the header's bytes and the slots msgpack allocates for an array when it reads its
length: at most 8 bytes per byte of header, since header.py first checks (building nothing) that every
array the header claims is there.

`save` reads the header it is about to write with the same code (header.py), so the limit holds on both sides.
"""

import io
import sys
from collections.abc import Iterable
from typing import Any

import msgpack

MAX_HEADER_EXPANSION = 16  # bytes of Python objects per byte of header, at most
HEADER_SLACK_BYTES = 2**20  # a small header may cost this much more: a config's dicts and strings
_READ_BYTES = 16 * 2**10
_ELEMENT_BOUND = 56  # an int or float, a str of up to 7 ASCII characters, and the element's slot


class OverBudget(ValueError):
    """The header decodes to more memory than its budget allows."""


class Budget:
    """A count of the bytes of Python objects built from a header of `header_bytes` bytes, and its limit."""

    def __init__(self, header_bytes: int):
        self.header_bytes, self.used = header_bytes, 0
        self.limit = MAX_HEADER_EXPANSION * header_bytes + HEADER_SLACK_BYTES

    def charge(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.limit:
            self._refuse()

    def _refuse(self) -> None:
        raise OverBudget(
            f"the header decodes to more than {self.limit:,} bytes of Python objects, the most a reader builds "
            f"for a {self.header_bytes:,}-byte header ({MAX_HEADER_EXPANSION} times its size, plus 1 MiB)"
        )

    def keep(self, value: Any) -> Any:
        """Charge a value read whole and kept: its containers were charged as msgpack built them; a scalar now."""
        self.charge(_scalar_bytes((value,)))
        return value

    def charge_list(self, items: list) -> list:
        """msgpack's `list_hook`: charge a list just built (its nested containers were charged as they were built)."""
        self.used += sys.getsizeof(items) + (_scalar_bytes(items) if items else 0)  # inlined: called per container
        if self.used > self.limit:
            self._refuse()
        return items

    def charge_map(self, mapping: dict) -> dict:
        """msgpack's `object_hook`: charge a dict just built, its keys and its scalar values."""
        if mapping:
            self.used += _scalar_bytes(mapping.keys()) + _scalar_bytes(mapping.values())
        self.used += sys.getsizeof(mapping)
        if self.used > self.limit:
            self._refuse()
        return mapping

    def bound_list(self, items: list) -> list:
        """`charge_list` at a bound per element instead of each element's size: quicker, for what is dropped
        at once (a manifest entry), where only a crafted value of millions of elements could matter."""
        self.charge(sys.getsizeof(items) + _ELEMENT_BOUND * len(items))
        return items

    def bound_map(self, mapping: dict) -> dict:
        self.charge(sys.getsizeof(mapping) + 2 * _ELEMENT_BOUND * len(mapping))
        return mapping


def _scalar_bytes(values: Iterable[Any]) -> int:
    """The memory of the scalars among `values` that decoding allocated (CPython shares None, booleans, the
    integers -5..256 and one-character strings and bytes, so those cost nothing but their slot)."""
    total = 0
    for x in values:
        kind = type(x)
        if kind is int:
            total += 0 if -5 <= x <= 256 else sys.getsizeof(x)
        elif kind is str or kind is bytes:
            total += 0 if len(x) <= 1 else sys.getsizeof(x)
        elif kind is float:
            total += 24
    return total


class Stream:
    """The msgpack values of `raw` from byte `start` on, one call at a time, each container charged to `budget`
    as msgpack builds it: exactly, or with `bound=True` at `Budget.bound_list`'s bound.

    `value()` reads the next value whole, `skip()` passes over it without building it; both raise msgpack's
    own exceptions for malformed bytes (`msgpack.OutOfData` where the header ends inside a value), and
    `OverBudget` once the budget is spent."""

    def __init__(self, raw: bytes, budget: Budget, start: int = 0, *, bound: bool = False):
        data = io.BytesIO(raw)  # shares `raw`'s memory; the unpacker reads it in small pieces
        data.seek(start)
        self.budget, self.start, self.raw = budget, start, raw
        self._unpacker = msgpack.Unpacker(
            data,
            read_size=_READ_BYTES,  # its buffer: msgpack's default is 1 MiB, for every stream
            max_buffer_size=max(len(raw), _READ_BYTES),  # it grows to hold the largest string, at most all of `raw`
            raw=False,
            strict_map_key=False,
            max_ext_len=0,
            list_hook=budget.bound_list if bound else budget.charge_list,
            object_hook=budget.bound_map if bound else budget.charge_map,
        )
        self.value, self.skip = self._unpacker.unpack, self._unpacker.skip

    @property
    def offset(self) -> int:
        """The offset in `raw` of the next value."""
        return self.start + self._unpacker.tell()

    def at(self, offset: int) -> "Stream":
        """Another stream over the same bytes and budget, from `offset` (one this stream passed over)."""
        return Stream(self.raw, self.budget, offset)

    def map_header(self) -> int | None:
        """The number of entries of the map that comes next (then read its keys and values one by one), or
        None, reading nothing, when the next value is not a map."""
        return self._header(self._unpacker.read_map_header)

    def array_header(self) -> int | None:
        """The number of elements of the array that comes next, or None, reading nothing, if it is not one."""
        return self._header(self._unpacker.read_array_header)

    def _header(self, read) -> int | None:
        try:
            return read()
        except msgpack.OutOfData:
            raise
        except ValueError:  # "Unexpected type header on stream" (the position is unchanged) or a reserved byte
            return None
