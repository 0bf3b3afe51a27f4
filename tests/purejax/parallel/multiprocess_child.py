"""Child program for the multi-process tests, started by `purejax.parallel.launch` as 1 or N processes.

Trains the MLP classifier (models/mlp.py) data-parallel with Adam for a few steps, with a plain
`jax.shard_map` step: the loss is averaged over "data" with `pmean`, and under check_vma JAX's transpose then
sums the gradients of the replicated params, so no collective is written for them. Each process reads only
its own rows of each global batch from the data files (numpy memmaps). At the end every process prints one
JSON line: its loss trajectory, final params and the collectives of its compiled step, which the test
compares across processes and against a 1-process run.

    python multiprocess_child.py train DATA_DIR OUT_DIR   # also saves and restores a checkpoint
    python multiprocess_child.py die:1 DATA_DIR OUT_DIR   # process 1 (or die:0, 0) kills itself after step 2

DATA_DIR holds x.npy (steps, global_batch, d_in) float32 and labels.npy (steps, global_batch) int32.
(An MLP rather than the GPT: JAX's persistent compilation cache serves only process 0, so every other
process compiles each program afresh, and a GPT step takes it 10-20 s on this shared CPU.)

The distributed settings come from the environment the launcher sets (PUREJAX_COORDINATOR, ...).
"""

import json
import os
import re
import signal
import sys
from pathlib import Path

from purejax.parallel import distributed

# First, before any JAX call. Small timeouts so that a dead peer is noticed in seconds, not minutes.
distributed.initialize(heartbeat_timeout_seconds=3, shutdown_timeout_seconds=3)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import mlp  # noqa: E402
from purejax import checkpoint, tree  # noqa: E402
from purejax.parallel import make_mesh  # noqa: E402

CONFIG = mlp.MLPConfig(d_in=16, hidden=(32,), n_classes=4)
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def make_train_step(mesh: Mesh, optimizer: optax.GradientTransformation):
    def loss(params, batch):  # runs on each device's shard of the batch
        return jax.lax.pmean(mlp.loss(params, batch, CONFIG), "data")

    grad_fn = jax.shard_map(
        jax.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=True
    )

    @jax.jit
    def train_step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step


def host(x) -> np.ndarray:
    """The value of a replicated global array (each process holds a full copy)."""
    assert x.is_fully_replicated, x.sharding
    return np.asarray(x.addressable_data(0))


def rows_on_meshes() -> dict[str, list[int]]:
    """The rows of a global batch of 8 this process owns under P("data") on purejax.parallel's meshes."""
    out = {}
    for dp, tp in [(4, 1), (2, 2), (1, 4)]:
        rows = distributed.local_rows(NamedSharding(make_mesh(dp, tp), P("data")), (8,))
        out[f"dp={dp},tp={tp}"] = [rows.start, rows.stop]
    return out


def check_errors(x: np.ndarray) -> list[str]:
    """Errors that need several processes or devices: joining a second, different run; rows from a mesh that
    interleaves processes; a process passing the wrong number of rows; a batch the data axis cannot split
    evenly. None of them runs a collective."""
    distributed.initialize()  # again, from the same environment: a no-op
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    interleaved = [d for group in zip(*by_process) for d in group]  # p0 d0, p1 d0, p0 d1, p1 d1
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    return [
        error_of(distributed.initialize, num_processes=3),
        error_of(distributed.local_rows, NamedSharding(Mesh(np.array(interleaved), ("data",)), P("data")), (8, 8)),
        error_of(distributed.global_batch, {"x": np.asarray(x[0])}, sharding, x.shape[1]),  # all rows, not ours
        error_of(distributed.local_rows, sharding, (6, x.shape[2])),  # 6 rows over 4 devices
    ]


def error_of(call, *args, **kwargs) -> str:
    try:
        call(*args, **kwargs)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return f"{call.__name__} raised no error"


def main(mode: str, data_dir: str, out_dir: str) -> None:
    x = np.load(Path(data_dir) / "x.npy", mmap_mode="r")  # read lazily: only the rows sliced below
    labels = np.load(Path(data_dir) / "labels.npy", mmap_mode="r")
    steps, global_batch_size = labels.shape
    mesh = Mesh(np.array(jax.devices()), ("data",))  # process by process, so each owns a block of rows
    batch_sharding = NamedSharding(mesh, P("data"))
    rows = distributed.local_rows(batch_sharding, x.shape[1:])
    errors = check_errors(x) if jax.process_count() > 1 else []

    optimizer = optax.adam(5e-2)
    replicated = NamedSharding(mesh, P())
    params = jax.jit(mlp.init, static_argnums=1, out_shardings=replicated)(jax.random.key(0), CONFIG)
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)
    train_step = make_train_step(mesh, optimizer)

    losses, batch = [], None
    for step in range(steps):
        local = (x[step, rows.start : rows.stop], labels[step, rows.start : rows.stop])  # only our rows
        batch = distributed.global_batch(local, batch_sharding, global_batch_size)
        if step == 0:
            hlo = train_step.lower(params, opt_state, batch).compile().as_text()
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(host(loss)))
        if distributed.is_main():
            print(f"log: step {step} loss {losses[-1]:.4f}", flush=True)
        if mode == f"die:{jax.process_index()}" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    result = {
        "process": jax.process_index(),
        "rows": [rows.start, rows.stop],
        "devices": [jax.local_device_count(), jax.device_count()],
        "cpu_collectives": jax.config.jax_cpu_collectives_implementation,
        "rows_on_meshes": rows_on_meshes(),
        "losses": losses,
        "params": {k: host(v).ravel().tolist() for k, v in tree.flatten(params).items()},
        "collectives": COLLECTIVE.findall(hlo),
        "errors": errors,
    }
    if mode == "train":
        result["checkpoint"] = save_and_restore(Path(out_dir), params, batch[0], steps)
    print("RESULT " + json.dumps(result), flush=True)


def save_and_restore(out_dir: Path, params: dict, x: jax.Array, step: int) -> dict:
    """Every process calls save with a relative path in its own working directory, so a file written by any
    process but 0 would show up in that process's directory; then every process restores process 0's file."""
    own_dir = out_dir / f"process_{jax.process_index()}"
    own_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(own_dir)
    assert not x.is_fully_addressable or jax.process_count() == 1  # the batch spans the processes
    checkpoint.save("ckpt.msgpack", {"params": params, "x": x}, step=step)
    shared = out_dir / "process_0" / "ckpt.msgpack"
    loose, info = checkpoint.restore(shared)  # numpy, the global values
    placed, _ = checkpoint.restore(shared, like={"params": params, "x": x})  # onto the same shardings
    same_shards = all(
        np.array_equal(a.data, b.data) and a.index == b.index
        for a, b in zip(placed["x"].addressable_shards, x.addressable_shards)
    )
    return {
        "step": info.step,
        "x": np.asarray(loose["x"]).tolist(),
        "same_params": _same_params(loose["params"], placed["params"], params),
        "same_shards": same_shards and placed["x"].sharding == x.sharding,
        "files_here": sorted(p.name for p in own_dir.iterdir()),
    }


def _same_params(loose: dict, placed: dict, params: dict) -> bool:
    flat_loose, flat_placed = tree.flatten(loose), tree.flatten(placed)
    return all(
        np.array_equal(flat_loose[k], host(v)) and np.array_equal(host(flat_placed[k]), host(v))
        for k, v in tree.flatten(params).items()
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
