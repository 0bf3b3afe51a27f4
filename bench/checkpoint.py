"""Checkpoint save and load: purejax.checkpoint against flax.serialization (msgpack), orbax, safetensors and
numpy.savez, with the disk's raw write+fsync and read bandwidth as the ceiling, in one run.

    python -m bench.checkpoint [--repeats 3] [--dir /tmp]
    python -m bench.checkpoint --cases bf16 --methods raw,purejax,purejax-reference   # the two paths, quickly

Two trees (bench/checkpoint_trees.py): GPT-2 small's parameters (124M, float32) with an AdamW state (optax's,
mu and nu), 1.5 GB; and the same parameters in bfloat16, 249 MB. The methods are in bench/checkpoint_methods.py;
this file measures them and prints the tables. Every save is made durable: purejax fsyncs the file and its
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

from bench import checkpoint_methods as methods_lib
from bench.checkpoint_methods import EXTRA_METHODS, METHODS, drop_from_page_cache, files
from bench.checkpoint_trees import CASES, abstract_tree, make_tree

# ---------------------------------------------------------------- one measurement, in a child process


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(action: str, method: str, case: str, path: str) -> dict:
    """One save (of a freshly made tree) or one load, measured in this process."""
    abstract = abstract_tree(case)["params"] if method == "purejax-params" else abstract_tree(case)
    data = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract))
    if action == "save":
        tree = make_tree(case)
        # XLA's threads go on unmapping the temporaries for some 50 ms after the tree is ready, holding the
        # address-space lock that any mmap (a new thread's stack, say) then waits on: let them finish first.
        time.sleep(1.0)
        before, start = peak_bytes(), time.perf_counter()
        seconds = methods_lib.save_function(method)(tree, path)
        seconds = time.perf_counter() - start if seconds is None else seconds
        size = sum(p.stat().st_size for p in files(Path(path)))
        return {"seconds": seconds, "extra": (peak_bytes() - before) / data, "size": size, "data": data}
    load, times = methods_lib.load_function(method), []
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
        runs = run_rounds(case, methods, args.repeats, args.dir)
        rows = [(method, *best(results), save_ratio(results, runs.get("raw"))) for method, results in runs.items()]
        print_table(case, rows)


def run_rounds(case: str, methods: list[str], repeats: int, directory: str) -> dict[str, list[tuple[dict, dict]]]:
    """{method: [(save, load) of each round]}: `repeats` rounds, each method once per round, each round starting
    one method later; "purejax-params" loads the params of the file "purejax" saved in the same round."""
    runs: dict[str, list[tuple[dict, dict]]] = {}
    order = [m for m in methods if m != "purejax-params"]
    for round_ in range(repeats):  # rounds, so that a slow spell of a shared machine hits every method
        for method in order[round_ % len(order) :] + order[: round_ % len(order)]:  # each round starts later
            os.sync()  # nothing left over from the measurement before for the disk to write meanwhile
            work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=directory))
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
    return runs


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
