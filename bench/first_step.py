"""Time to the first step: the wall time from the command to the first finished training step, cold and with
the persistent compilation cache, for purejax's programs and for the raw JAX and Flax NNX GPTs of
bench/gpt_train.py.

    python -m bench.first_step [--repeats 3] [--contenders gpt,raw,nnx,flow,classify]

Each start is a fresh Python process, as a user starts it:

    gpt       python -m train.gpt          the default run (gpt_cpu preset; its evaluation at iteration 0
                                            comes before the first step, as nanoGPT's does)
    raw, nnx  python -m bench.first_step_peer raw|nnx   the same GPT and batch in raw JAX or Flax NNX, AdamW,
                                            one jitted step (the benchmark's scaffolding subtracted: see there)
    flow      python -m train.flow         the default run (flow_digits)
    classify  python -m train.classify     the default run (classify_digits; needs scikit-learn's digits)

The clock starts when the process is spawned and stops when it says its first step has finished (purejax's
programs print "compiled and ran the first step" after waiting for it; the peers after `block_until_ready`);
the process is then stopped. "cold": no compilation cache. "cached": the second of two starts sharing a fresh
cache directory (`--compile_cache=<dir>`; for the peers JAX's own cache through JAX_COMPILATION_CACHE_DIR, its
thresholds at 0 as purejax's programs set them, so every program is cached: the peers' best start). Each
figure is the median of --repeats starts, the contenders interleaved. Before timing, one start of each
program prepares its data (the built-in corpus, the digits), which later starts only read.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
DONE = ("compiled and ran the first step", "first step done")
COMMANDS = {
    "gpt": ["-m", "train.gpt", "--progress=false"],
    "raw": ["-m", "bench.first_step_peer", "raw"],
    "nnx": ["-m", "bench.first_step_peer", "nnx"],
    "flow": ["-m", "train.flow", "--progress=false"],
    "classify": ["-m", "train.classify", "--progress=false"],
}
PEERS = ("raw", "nnx")


def start_seconds(contender: str, cache: Path | None, out_dir: Path) -> float:
    """Seconds from spawning `contender` to its first finished step (less a peer's scaffolding), with the
    compilation cache in `cache` (None: off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, *COMMANDS[contender]]
    if contender in PEERS:
        if cache is not None:
            env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
            env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    else:
        command += [f"--out_dir={out_dir}", f"--compile_cache={cache or 'off'}"]
    began, scaffolding = time.perf_counter(), 0.0
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("scaffolding "):
                scaffolding = float(line.split()[1])
            if line.startswith(DONE):
                return time.perf_counter() - began - scaffolding
    finally:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{contender} ended before its first step:\n{''.join(seen[-20:])}")


def measure(contenders: list[str], repeats: int, work: Path) -> dict[str, dict[str, float]]:
    """{contender: {"cold": s, "cached": s}}: medians over `repeats` starts, interleaved."""
    for contender in contenders:  # data prepared once (the corpus, the digits); not timed
        start_seconds(contender, None, work / "prepare")
    samples = {c: {"cold": [], "cached": []} for c in contenders}
    for r in range(repeats):
        for contender in contenders:
            samples[contender]["cold"].append(start_seconds(contender, None, work / f"{contender}-{r}"))
            cache = work / f"cache-{contender}-{r}"
            start_seconds(contender, cache, work / f"{contender}-{r}-fill")  # fills the cache
            samples[contender]["cached"].append(start_seconds(contender, cache, work / f"{contender}-{r}-hit"))
    return {c: {kind: statistics.median(s) for kind, s in kinds.items()} for c, kinds in samples.items()}


def table(results: dict[str, dict[str, float]]) -> str:
    """Markdown: seconds to the first step, cold and cached, and each relative to raw JAX's."""
    raw = results.get("raw")
    lines = ["| contender | cold s | cold / raw | cached s | cached / raw |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        ratios = [f"{r[k] / raw[k]:.2f}x" if raw else "-" for k in ("cold", "cached")]
        lines.append(f"| {name} | {r['cold']:.2f} | {ratios[0]} | {r['cached']:.2f} | {ratios[1]} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", default="gpt,raw,nnx,flow,classify")
    args = parser.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(contenders) - set(COMMANDS))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {sorted(COMMANDS)}")
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as work:
        results = measure(contenders, args.repeats, Path(work))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
