"""Child process for the bounded-memory tests: the peak RSS a save or a restore adds, printed as JSON.

    python peak_memory.py save FILE MB CHUNK_BYTES     create MB of jax arrays, then save them to FILE
    python peak_memory.py restore FILE like|numpy      restore FILE into a jax template, or as numpy

The baseline is the peak RSS after the data exists and after a small warm-up save or restore (imports,
thread pool), so the figure is what the large call itself added. A fresh process per measurement, because
`ru_maxrss` only ever grows.
"""

import json
import resource
import sys

import jax
import jax.numpy as jnp
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


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
