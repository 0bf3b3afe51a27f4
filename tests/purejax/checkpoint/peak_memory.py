"""Child process for the bounded-memory tests: the peak RSS a save or a restore adds, printed as JSON.

    python peak_memory.py save FILE MB CHUNK_BYTES     create MB of jax arrays, then save them to FILE
    python peak_memory.py restore FILE like|numpy      restore FILE into a jax template, or as numpy

And what a large header costs to read (docs/benchmarks.md, "A large header"), by hand:

    python peak_memory.py many-leaves FILE N           save N tiny leaves (N/2 blocks of two) to FILE
    python peak_memory.py empty-lists FILE N           write a valid checkpoint whose metadata is N empty lists
    python peak_memory.py read FILE metadata|restore   the seconds and peak RSS of reading FILE

The baseline is the peak RSS after the data exists and after a small warm-up save or restore (imports,
thread pool), so the figure is what the large call itself added. A fresh process per measurement, because
`ru_maxrss` only ever grows.
"""

import json
import resource
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import msgpack
import numpy as np

from purejax import checkpoint


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(mode: str, path: str, *args: str) -> dict:
    checkpoint.save(path + ".warm", {"x": jnp.ones(1000)})
    if mode == "save":
        megabytes, chunk_bytes = int(args[0]), int(args[1])
        leaves = {f"w{i}": jnp.full((megabytes // 4, 2**18), i, jnp.float32) for i in range(4)}  # MB/4 each
        jax.block_until_ready(leaves)
        before = peak_bytes()
        checkpoint.save(path, {"params": leaves, "step": np.int64(1)}, chunk_bytes=chunk_bytes)
        return {"data": sum(x.nbytes for x in leaves.values()), "extra": peak_bytes() - before}
    checkpoint.restore(path + ".warm", like={"x": jax.ShapeDtypeStruct((1000,), jnp.float32)})
    info = checkpoint.read_metadata(path)
    params = {leaf.path.removeprefix("params."): leaf.shape for leaf in info.leaves if leaf.path != "step"}
    like = {"params": {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in params.items()}, "step": np.int64(0)}
    before = peak_bytes()
    tree, _ = checkpoint.restore(path, like=like if args[0] == "like" else None)
    jax.block_until_ready(tree)
    result = {"data": sum(leaf.nbytes for leaf in info.leaves), "extra": peak_bytes() - before}
    if args[0] == "like":  # jax adopted the aligned read buffers: the arrays live where they were read
        result["jax_arrays"] = all(isinstance(x, jax.Array) for x in tree["params"].values())
    return result


def many_leaves(path: str, n: str) -> dict:
    blocks = [{"attention_weight": np.zeros(1, np.float32), "bias_term": np.zeros(2)} for _ in range(int(n) // 2)]
    checkpoint.save(path, {"blocks": blocks})
    return {"header": checkpoint.read_metadata(path).leaves[0].offset - 31}


def empty_lists(path: str, n: str) -> dict:
    """One float32[1] leaf; the metadata `{"x": [[], [], ...]}` spliced into the header as msgpack bytes."""
    crc = zlib.crc32(bytes(4)).to_bytes(4, "little")
    leaf = {"path": "w", "dtype": "float32", "shape": [1], "nbytes": 4, "crc32": crc, "key_impl": None}
    tree = {"kind": "dict", "keys": ["w"], "children": [{"kind": "leaf", "index": 0}]}
    fixed = {"purejax_version": "0", "created": "", "step": 1, "config": None, "byte_order": "little"}
    raw = msgpack.packb({**fixed, "chunk_bytes": 64, "metadata": {"x": 0}, "tree": tree, "leaves": [leaf]})
    raw = raw.replace(msgpack.packb({"x": 0}), b"\x81\xa1x\xdd" + int(n).to_bytes(4, "big") + b"\x90" * int(n))
    preamble = b"\x94\xb2purejax.checkpoint\x01\xce" + len(raw).to_bytes(4, "big") + b"\xce"
    with open(path, "wb") as f:
        f.write(preamble + zlib.crc32(raw).to_bytes(4, "big") + raw + b"\xc6\x00\x00\x00\x04" + bytes(4))
    return {"header": len(raw)}


def read(path: str, how: str) -> dict:
    before, start = peak_bytes(), time.perf_counter()
    try:
        (checkpoint.read_metadata if how == "metadata" else checkpoint.restore)(path)
        outcome = "read"
    except checkpoint.CheckpointError as e:
        outcome = f"refused: {e.problem[:60]}..."
    return {"seconds": round(time.perf_counter() - start, 2), "extra": peak_bytes() - before, "outcome": outcome}


if __name__ == "__main__":
    commands = {"many-leaves": many_leaves, "empty-lists": empty_lists, "read": read}
    print(json.dumps(commands.get(sys.argv[1], lambda *args: main(sys.argv[1], *args))(*sys.argv[2:])))
