"""The ways bench/checkpoint.py saves and loads a tree: purejax.checkpoint (its default threaded path, its
one-thread reference path, and a load of the params alone), its peers (safetensors, numpy.savez, orbax,
flax.serialization's msgpack), and the raw write+fsync and read of the same bytes, the disk's ceiling.

Each method `m` is a pair of functions, `save_m(tree, path)` and `load_m(path, case)` (the method's name with
"-" as "_"; "purejax-params" loads only, from purejax's file). Every save is made durable: purejax fsyncs its
file and its directory itself; for the others, which do not, `fsync_all` does it inside the timing. A load
returns the tree (jax arrays on the device) or, for the raw read, its own seconds.
"""

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.checkpoint_trees import abstract_tree
from purejax import checkpoint
from purejax import tree as tree_lib

METHODS = ["raw", "purejax", "purejax-params", "safetensors", "numpy", "orbax", "flax"]  # the default run
# Also measurable (--methods): purejax's reference path, one thread front to back (`threads=False`), the
# same bytes as its default fast path.
EXTRA_METHODS = ["purejax-reference"]


def save_function(method: str):
    """`method`'s save(tree, path)."""
    return globals()[f"save_{method.replace('-', '_')}"]


def load_function(method: str):
    """`method`'s load(path, case)."""
    return globals()[f"load_{method.replace('-', '_')}"]


def fsync_all(path: Path) -> None:
    """Make `path` (a file, or a directory tree) durable, as purejax does for its own file."""
    directories = [Path(d) for d, _, _ in os.walk(path)] if path.is_dir() else []
    for p in [*files(path), *directories, path.parent]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def files(path: Path) -> list[Path]:
    """`path` if it is a file, else every file under it (orbax writes a directory)."""
    return [path] if path.is_file() else [Path(d) / f for d, _, names in os.walk(path) for f in names]


def drop_from_page_cache(path: Path) -> None:
    for p in files(path):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def flat(tree) -> dict:
    return tree_lib.flatten(tree)


def save_raw(tree, path, piece: int = 512 * 2**10, hint_every: int = 64 * 2**20):
    """The tree's bytes, leaf after leaf from the arrays' own memory, in writes of 512 KiB (the write pattern
    that costs the least CPU here: each write's copy stays within the CPU's cache), with the hint that starts
    the disk on them every 64 MiB (as purejax does), then fsync: the sequential-write ceiling, everything a
    checkpoint writer must do except the checksums and the header. (The bytes must be the real,
    incompressible ones: a buffer of constants writes far faster on a disk that compresses or deduplicates,
    as this machine's virtual disk appears to.)"""
    start, offset, hinted = time.perf_counter(), 0, 0
    with open(path, "wb", buffering=0) as f:
        for leaf in jax.tree_util.tree_leaves(tree):
            data = np.asarray(leaf).reshape(-1).view(np.uint8)
            for begin in range(0, data.nbytes, piece):
                offset += f.write(data[begin : begin + piece])
                if offset - hinted >= hint_every:
                    os.posix_fadvise(f.fileno(), hinted, offset - hinted, os.POSIX_FADV_DONTNEED)
                    hinted = offset
        os.fsync(f.fileno())
    return time.perf_counter() - start


def load_raw(path, case):
    start = time.perf_counter()
    buffer = np.empty(os.path.getsize(path), np.uint8)  # into new memory, as every loader must
    with open(path, "rb", buffering=0) as f:
        f.readinto(buffer)
    return time.perf_counter() - start


def save_purejax(tree, path):
    checkpoint.save(path, tree)


def load_purejax(path, case):
    return checkpoint.restore(path, like=abstract_tree(case)).tree


def load_purejax_params(path, case):
    return checkpoint.restore(path, like=abstract_tree(case)["params"], subtree="params").tree


def save_purejax_reference(tree, path):
    checkpoint.save(path, tree, threads=False)


def load_purejax_reference(path, case):
    return checkpoint.restore(path, like=abstract_tree(case), threads=False).tree


def save_safetensors(tree, path):
    import safetensors.flax

    safetensors.flax.save_file(flat(tree), path)
    fsync_all(Path(path))


def load_safetensors(path, case):
    import safetensors.flax

    return safetensors.flax.load_file(path)


def save_numpy(tree, path):
    # npz has no bfloat16 (it would come back as void): store the bits as uint16, as users of npz must.
    arrays = {k: np.asarray(v) for k, v in flat(tree).items()}
    arrays = {k: v.view(np.uint16) if v.dtype == jnp.bfloat16 else v for k, v in arrays.items()}
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    fsync_all(Path(path))


def load_numpy(path, case):
    like = flat(abstract_tree(case))
    with np.load(path) as z:
        return {k: jax.device_put(z[k].view(like[k].dtype)) for k in z.files}


def save_orbax(tree, path):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(path).absolute(), flat(tree))
        checkpointer.wait_until_finished()
    fsync_all(Path(path))


def load_orbax(path, case):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(path).absolute(), flat(abstract_tree(case)))


def save_flax(tree, path):
    import flax.serialization

    data = flax.serialization.to_bytes(flat(tree))
    with open(path, "wb") as f:
        f.write(data)
    fsync_all(Path(path))


def load_flax(path, case):
    import flax.serialization

    with open(path, "rb") as f:
        restored = flax.serialization.msgpack_restore(f.read())
    return jax.device_put(restored)
