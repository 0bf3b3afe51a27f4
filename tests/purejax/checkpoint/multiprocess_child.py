"""One of two processes of a real multi-process run (jax.distributed over local TCP, 2 CPU devices each,
cross-process collectives by gloo). Both save one tree whose arrays span the two processes, restore it, save
into a missing directory and onto a disk that is full on process 0; prints "ok" at the end.

    python multiprocess_child.py PROCESS_ID PORT DIR
"""

import errno
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from purejax import checkpoint
from purejax.checkpoint import fast_write


def main(process_id: int, port: int, directory: str) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))  # rows of devices = processes
    shardings = {"w": NamedSharding(grid, P("data", "model")), "keys": NamedSharding(grid, P("data"))}
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 4))  # the same on both processes
    tree = {
        "w": jax.make_array_from_callback(w.shape, shardings["w"], lambda i: w[i]),
        "keys": jax.jit(lambda: jax.random.split(jax.random.key(0), 4), out_shardings=shardings["keys"])(),
        "local": np.full(3, process_id, np.int32),  # not a global array: the file gets process 0's
    }
    assert not tree["w"].is_fully_addressable and not tree["keys"].is_fully_addressable
    path = os.path.join(directory, "ckpt.msgpack")
    assert checkpoint.save(path, tree, step=5) is not None
    assert os.path.exists(path)  # every process returns only once process 0 has put the file in place

    loose, info = checkpoint.restore(path)  # every process reads the whole gathered value
    assert info.step == 5 and loose["w"].tobytes() == w.tobytes() and (loose["local"] == 0).all()
    assert np.asarray(jax.random.key_data(loose["keys"])).tobytes() == np.asarray(keys).tobytes()

    placed = checkpoint.restore(path, like=tree).tree  # each process places only the shards it holds
    for name, sharding in shardings.items():
        assert placed[name].sharding == sharding, name
    for shard in placed["w"].addressable_shards:
        assert shard.data.shape == (4, 4) and np.asarray(shard.data).tobytes() == w[shard.index].tobytes()
    for shard in placed["keys"].addressable_shards:
        assert np.asarray(jax.random.key_data(shard.data)).tobytes() == np.asarray(keys[shard.index]).tobytes()

    one = SingleDeviceSharding(jax.local_devices()[1])  # the whole value onto one local device
    alone = checkpoint.restore(path, like=jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=one), subtree="w").tree
    assert alone.sharding == one and np.asarray(alone).tobytes() == w.tobytes()

    # Process 0 cannot write: it raises its own error, the other process is told rather than left waiting.
    try:
        checkpoint.save(os.path.join(directory, "missing", "ckpt.msgpack"), tree)
        raise AssertionError("saving into a missing directory did not fail")
    except FileNotFoundError:
        assert process_id == 0
    except RuntimeError as e:
        assert process_id == 1 and "process 0 failed to write" in str(e), e

    # Process 0's disk is full: every process raises CheckpointWriteError (process 0's names the space left).
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    if process_id == 0:
        fast_write._write_at = full
    try:
        checkpoint.save(path, tree, step=6)
        raise AssertionError("saving onto a full disk did not fail")
    except checkpoint.CheckpointWriteError as e:
        assert e.errno == errno.ENOSPC and e.needed == os.path.getsize(path), e  # step 6's file is step 5's size
        assert (e.free is not None) == (process_id == 0) and "intact" in str(e), e
    assert checkpoint.read_metadata(path).step == 5
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
