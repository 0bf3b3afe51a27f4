"""Child process for the sharded tests: 4 simulated CPU devices (XLA_FLAGS must be set before jax is
imported, and the test process has one device). Saves sharded arrays, then restores them three ways and
checks values and placement; prints "ok" at the end.

    python sharded_child.py FILE
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from purejax import checkpoint  # noqa: E402


def bits(x) -> bytes:
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x).tobytes()


def main(path: str) -> None:
    assert jax.device_count() == 4, jax.devices()
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    expected = {
        "w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
        "b": jnp.arange(8, dtype=jnp.bfloat16),
        "keys": jax.random.split(jax.random.key(0), 4),
    }
    saved = {
        "w": jax.device_put(expected["w"], NamedSharding(grid, P("data", "model"))),  # 4 blocks of 4x4
        "b": jax.device_put(expected["b"], NamedSharding(grid, P("model"))),  # halves, replicated over "data"
        "keys": jax.device_put(expected["keys"], NamedSharding(grid, P("data"))),  # typed keys, sharded
    }
    checkpoint.save(path, saved, step=1)
    # Saving did not leave a host copy of the whole array cached on the caller's sharded arrays.
    assert all(getattr(x, "_npy_value", None) is None for x in saved.values())

    # 1. The file holds the global values, gathered from the shards.
    loose = checkpoint.restore(path).tree
    assert all(bits(loose[k]) == bits(expected[k]) for k in expected)

    # 2. Into the same shardings: every device holds only its own slice.
    same = checkpoint.restore(path, like=saved).tree
    for name, x in same.items():
        assert x.sharding == saved[name].sharding, name
        assert bits(x) == bits(expected[name]), name
    assert {s.data.shape for s in same["w"].addressable_shards} == {(4, 4)}

    # 3. Onto a different layout (rows over a 1-D mesh of 4), given as ShapeDtypeStructs.
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows) for k, x in expected.items()}
    moved = checkpoint.restore(path, like=like).tree
    for name, x in moved.items():
        assert x.sharding == rows and bits(x) == bits(expected[name]), name
    assert {s.data.shape for s in moved["w"].addressable_shards} == {(2, 8)}
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
