"""Checkpoint save and load: purejax.checkpoint against flax.serialization (msgpack), orbax, safetensors and
numpy.savez, with the disk's raw write+fsync and read bandwidth as the ceiling, in one run.

    python -m bench.checkpoint [--repeats 3] [--dir /tmp]
    python -m bench.checkpoint --cases bf16 --methods raw,purejax,purejax-reference   # the two paths, quickly

Two trees: GPT-2 small's parameters (124M, float32) with an AdamW state (optax's, mu and nu), 1.5 GB; and
the same parameters in bfloat16, 249 MB. Every save is made durable: purejax fsyncs the file and its
directory itself; for the others, which do not, the benchmark fsyncs every file they wrote, inside the
timing. Every load ends with jax arrays on the device (`jax.block_until_ready`). Each file is loaded twice:
first from the disk (its pages dropped from the page cache with `posix_fadvise(DONTNEED)`), then again from
the page cache, which isolates the loader's own cost (copies, checksums, placement) from the disk's.

Each measurement runs in a fresh process, and its memory is the peak RSS (`ru_maxrss`) it added over the
process's peak once the tree existed (save) or before loading (load), as a multiple of the data: 0 means no
copy; 1.0 for a load means only the result itself. The run makes `--repeats` rounds, each method once per
round, interleaved (each round starting one method later, with an `os.sync()` before every measurement),
so that a slow spell of the (shared) machine hits them all alike; a time is the best over the rounds, a
memory figure the largest, and "save / raw" the median over the rounds of the save's
time over the raw write's in the same round (the disk's speed wanders, so best against best can mislead).
Temporary files go under `--dir` and are deleted.
"""

import argparse
import functools
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import checkpoint
from purejax import tree as tree_lib

CASES = {"adamw": "GPT-2 small params + AdamW state, float32", "bf16": "GPT-2 small params, bfloat16"}
METHODS = ["raw", "purejax", "purejax-params", "safetensors", "numpy", "orbax", "flax"]  # the default run
# Also measurable (--methods): purejax's reference path, one thread front to back (`threads=False`), the
# same bytes as its default fast path.
EXTRA_METHODS = ["purejax-reference"]

# ---------------------------------------------------------------- the trees


def gpt2_shapes(d: int = 768, n_layer: int = 12, vocab: int = 50257, n_ctx: int = 1024) -> dict:
    """GPT-2 small's parameter shapes (124M), in purejax's naming."""

    def linear(d_in, d_out):
        return {"w": (d_in, d_out), "b": (d_out,)}

    def norm():
        return {"scale": (d,), "bias": (d,)}

    block = {
        "ln_1": norm(),
        "attn": {"qkv": linear(d, 3 * d), "proj": linear(d, d)},
        "ln_2": norm(),
        "mlp": {"fc": linear(d, 4 * d), "proj": linear(4 * d, d)},
    }
    return {"wte": (vocab, d), "wpe": (n_ctx, d), "blocks": [block] * n_layer, "ln_f": norm()}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random(key, shape, dtype):
    return jax.random.uniform(key, shape, jnp.float32, -1, 1).astype(dtype)  # fused: no float32 temporary


def abstract_tree(case: str):
    is_shape = lambda s: isinstance(s, tuple) and all(isinstance(d, int) for d in s)  # noqa: E731
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, dtype), gpt2_shapes(), is_leaf=is_shape)
    if case == "bf16":
        return params
    return {"params": params, "opt_state": jax.eval_shape(optax.adamw(3e-4).init, params)}


def make_tree(case: str):
    """The tree, every leaf random (so nothing compresses), made one leaf at a time without temporaries."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract_tree(case))
    key = jax.random.key(0)
    made = [_random(jax.random.fold_in(key, i), x.shape, x.dtype) for i, x in enumerate(leaves)]
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, made))


# ---------------------------------------------------------------- the methods: save(tree, path), load(path, case)


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


# ---------------------------------------------------------------- one measurement, in a child process


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(action: str, method: str, case: str, path: str) -> dict:
    """One save (of a freshly made tree) or one load, measured in this process."""
    name = method.replace("-", "_")
    abstract = abstract_tree(case)["params"] if method == "purejax-params" else abstract_tree(case)
    data = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract))
    if action == "save":
        tree = make_tree(case)
        # XLA's threads go on unmapping the temporaries for some 50 ms after the tree is ready, holding the
        # address-space lock that any mmap (a new thread's stack, say) then waits on: let them finish first.
        time.sleep(1.0)
        before, start = peak_bytes(), time.perf_counter()
        seconds = globals()[f"save_{name}"](tree, path)
        seconds = time.perf_counter() - start if seconds is None else seconds
        size = sum(p.stat().st_size for p in files(Path(path)))
        return {"seconds": seconds, "extra": (peak_bytes() - before) / data, "size": size, "data": data}
    load, times = globals()[f"load_{name}"], []
    drop_from_page_cache(Path(path))  # the first load reads from the disk, the second from the page cache
    gc.collect()
    before = peak_bytes()
    for attempt in range(2):
        start = time.perf_counter()
        result = jax.block_until_ready(load(path, case))
        times.append(result if isinstance(result, float) else time.perf_counter() - start)
        if attempt == 0:
            extra = (peak_bytes() - before) / data
        del result
        gc.collect()
    return {"seconds": times[0], "warm": times[1], "extra": extra, "data": data}


def run_child(*args: str) -> dict:
    command = [sys.executable, "-m", "bench.checkpoint", "--child", *args]
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the run and the table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each method once per round, interleaved")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary files go")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS + EXTRA_METHODS)}")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, files under {args.dir}, best of {args.repeats} rounds")
    methods = args.methods.split(",")
    for case in args.cases.split(","):
        runs: dict[str, list[tuple[dict, dict]]] = {}
        order = [m for m in methods if m != "purejax-params"]
        for round_ in range(args.repeats):  # rounds, so that a slow spell of a shared machine hits every method
            for method in order[round_ % len(order) :] + order[: round_ % len(order)]:  # each round starts later
                os.sync()  # nothing left over from the measurement before for the disk to write meanwhile
                work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
                path = str(work / "ckpt")
                try:
                    saved = run_child("save", method, case, path)
                    loaded = saved if "error" in saved else run_child("load", method, case, path)
                    runs.setdefault(method, []).append((saved, loaded))
                    report(case, method, saved, loaded)
                    if method == "purejax" and "purejax-params" in methods and case == "adamw" and "error" not in saved:
                        partial = run_child("load", "purejax-params", case, path)  # the params of the same file
                        runs.setdefault("purejax-params", []).append((saved, partial))
                        report(case, "purejax-params", {}, partial)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        rows = [(method, *best(results), save_ratio(results, runs.get("raw"))) for method, results in runs.items()]
        print_table(case, rows)


def best(results: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The fastest save and load over the rounds, with the largest memory any round needed."""
    merged = []
    for part in range(2):
        runs = [r[part] for r in results]
        if any("error" in r for r in runs):
            merged.append(next(r for r in runs if "error" in r))
            continue
        fastest = min(runs, key=lambda r: r["seconds"])
        warm = {"warm": min(r["warm"] for r in runs)} if part == 1 else {}
        merged.append({**fastest, **warm, "extra": max(r["extra"] for r in runs)})
    return merged[0], merged[1]


def save_ratio(results: list[tuple[dict, dict]], raw: list[tuple[dict, dict]] | None) -> float:
    """The median over rounds of this method's save time over the raw write's in the same round: steadier
    than best against best on a disk whose speed wanders from one second to the next."""
    pairs = [(r[0], w[0]) for r, w in zip(results, raw or []) if "seconds" in r[0] and "seconds" in w[0]]
    return statistics.median(r["seconds"] / w["seconds"] for r, w in pairs) if pairs else float("nan")


def report(case: str, method: str, saved: dict, loaded: dict) -> None:
    save_s, load_s = saved.get("seconds", float("nan")), loaded.get("seconds", float("nan"))
    errors = " ".join(r["error"] for r in (saved, loaded) if "error" in r)
    print(f"  {case:6} {method:15} save {save_s:6.2f} s  load {load_s:6.2f} s  {errors}", flush=True)


def print_table(case: str, rows: list) -> None:
    data = next((saved["data"] for _, saved, _, _ in rows if "data" in saved), 0)
    print(f"\n{CASES[case]}: {data / 1e9:.2f} GB\n")
    columns = ["save + fsync (s)", "save / raw (median)", "load from disk (s)", "load from page cache (s)", "file (GB)"]
    print("| method | " + " | ".join([*columns, "extra memory, save", "extra memory, load"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method, saved, loaded, ratio in rows:
        if "error" in saved or "error" in loaded:
            print(f"| {method} | failed: {saved.get('error') or loaded.get('error')} |||||||")
            continue
        loads = [f"{loaded['seconds']:.2f}", f"{loaded['warm']:.2f}"]
        if method == "raw":
            cells = ["raw write+fsync / read (ceiling)", f"{saved['seconds']:.2f}", "1", *loads, "-", "-"]
        elif method == "purejax-params":
            of = f"{loaded['extra']:.2f}x of {loaded['data'] / 1e9:.2f} GB"
            cells = ["purejax, params only (`subtree=`)", "-", "-", *loads, "-", of]
        else:
            memory = [f"{saved['extra']:.2f}x", f"{loaded['extra']:.2f}x"]
            cells = [method, f"{saved['seconds']:.2f}", f"{ratio:.2f}x", *loads, *memory]
        size = f"{saved['size'] / 1e9:.2f}" if "size" in saved and method != "purejax-params" else "-"
        print("| " + " | ".join([*cells[:5], size, *cells[5:]]) + " |")
    print()


if __name__ == "__main__":
    main()
