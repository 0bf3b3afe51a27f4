"""Single-file checkpoints: safe, atomic, checksummed, streaming.

    from purejax import checkpoint

    checkpoint.save("run/ckpt.msgpack", {"params": params, "opt_state": opt_state, "key": key}, step=step)
    state, info = checkpoint.restore("run/ckpt.msgpack", like=state)      # validated, placed, sharded
    params, _ = checkpoint.restore("run/ckpt.msgpack", subtree="params")  # reads only the params' bytes
    checkpoint.read_metadata("run/ckpt.msgpack").step                     # reads no array bytes

    manager = checkpoint.CheckpointManager("run", keep_last=3)           # a directory of checkpoints
    manager.save(step, state)
    restored = manager.restore(like=state)                               # newest valid one, or None

The file format (msgpack, readable without purejax) is specified in docs/checkpoint-format.md; the user
guide is docs/checkpoint.md. Files, one idea each: `format` (the byte layout, the limits, CheckpointError),
`header` (the header map, built and checked), `nodes` (the tree's node kinds), `sequential` (the reference
I/O: one thread, front to back), `fast_write` and `fast_read` (the same bytes, with threads), `crc`
(joining CRC-32s), `write` (`save`), `read` (`restore`, `read_metadata`), `manager` (a directory of them).
"""

from purejax.checkpoint.format import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    CheckpointError,
    CheckpointInfo,
    CheckpointWriteError,
    LeafInfo,
)
from purejax.checkpoint.manager import CheckpointManager
from purejax.checkpoint.read import Restored, read_metadata, restore
from purejax.checkpoint.write import save

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWriteError",
    "LeafInfo",
    "Restored",
    "read_metadata",
    "restore",
    "save",
]
