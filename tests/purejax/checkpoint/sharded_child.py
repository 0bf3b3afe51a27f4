"""Child process for the sharded tests: 8 simulated CPU devices (XLA_FLAGS must be set before jax is
imported, and the test process has one device). Saves arrays sharded over a 4x2 ("data", "model") mesh, then
restores them four ways, checking values bit for bit and where each slice landed; prints "ok" at the end.

    python sharded_child.py FILE
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from purejax import checkpoint

SPECS = {"w": P("data", "model"), "b": P("model"), "keys": P("data"), "step": P()}


def bits(x) -> bytes:
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x).tobytes()


def shard_shapes(x) -> set[tuple[int, ...]]:
    return {s.data.shape for s in x.addressable_shards}


def check(restored: dict, shardings: dict, expected: dict) -> None:
    for name, x in restored.items():
        assert x.sharding == shardings[name], (name, x.sharding, shardings[name])
        assert bits(x) == bits(expected[name]), name


def main(path: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    expected = {
        "w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
        "b": jnp.arange(8, dtype=jnp.bfloat16),
        "keys": jax.random.split(jax.random.key(0), 8),
        "step": jnp.int32(7),
    }
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    on_grid = {k: NamedSharding(grid, spec) for k, spec in SPECS.items()}
    saved = {k: jax.device_put(x, on_grid[k]) for k, x in expected.items()}  # w: 8 blocks of 2x4
    checkpoint.save(path, saved, step=1)
    # Saving did not leave a host copy of the whole array cached on the caller's sharded arrays.
    assert all(getattr(x, "_npy_value", None) is None for x in saved.values())

    # 1. The file holds the global values, gathered from the shards.
    loose = checkpoint.restore(path).tree
    assert all(bits(loose[k]) == bits(expected[k]) for k in expected)

    # 2. Into the same shardings: every device holds only its own slice.
    same = checkpoint.restore(path, like=saved).tree
    check(same, on_grid, expected)
    assert shard_shapes(same["w"]) == {(2, 4)} and shard_shapes(same["keys"]) == {(2,)}

    # 3. Onto an 8x1 mesh with the same axis names, from a template of ShapeDtypeStructs (e.g. eval_shape).
    column = jax.make_mesh((8, 1), ("data", "model"))
    on_column = {k: NamedSharding(column, spec) for k, spec in SPECS.items()}
    like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_column[k]) for k, x in expected.items()}
    moved = checkpoint.restore(path, like=like).tree
    check(moved, on_column, expected)
    assert shard_shapes(moved["w"]) == {(1, 8)} and shard_shapes(moved["keys"]) == {(1,)}

    # 4. Onto one device, not the default one.
    one = {k: SingleDeviceSharding(jax.devices()[5]) for k in expected}
    like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one[k]) for k, x in expected.items()}
    check(checkpoint.restore(path, like=like).tree, one, expected)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
