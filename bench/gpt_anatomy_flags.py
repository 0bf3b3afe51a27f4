"""The flags section of bench/gpt_anatomy.py: the XLA:CPU flags this jaxlib knows, and purejax's step timed under
each promising one, each in a fresh process (`python -m bench.gpt_anatomy --worker CONFIG`: XLA_FLAGS is read
once, when the backend starts), with the loss after one update to see whether a flag changes the numerics.
"""

import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys

from bench.gpt_anatomy_hlo import DUMP_FLAGS, build_with_hlo
from bench.gpt_anatomy_steps import Setup, make_purejax_3d, medians, table
from bench.gpt_train_purejax import make_purejax

# XLA:CPU flags worth timing (all listed by `xla_cpu_flags()`), with what each changes.
FLAGS = {
    "default": "",
    "fast math": "--xla_cpu_enable_fast_math=true",
    "no YNNPACK (Eigen dots)": "--xla_cpu_experimental_ynn_fusion_type=",
    "YNNPACK without reductions": "--xla_cpu_experimental_ynn_fusion_type=-reduce",
    "oneDNN dot fusions": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_onednn_fusion_type=dot",
    "XNNPACK graph fusion": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "Eigen single-threaded": "--xla_cpu_multi_thread_eigen=false",
    "concurrency scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "tiling propagation": "--xla_cpu_experimental_enable_tiling_propagation=true",
    "old fusion emitters": "--xla_cpu_use_fusion_emitters=false",
    "copy insertion region analysis": "--xla_cpu_copy_insertion_use_region_analysis=true",
}


def xla_cpu_flags() -> list[str]:
    """Every `xla_cpu_*` flag name compiled into this jaxlib (the strings of libjax_common.so)."""
    import jaxlib

    names = set()
    for path in glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "*.so")):
        with open(path, "rb") as f:
            names |= {m.decode() for m in re.findall(rb"\x00(xla_cpu_[a-z0-9_]+)\x00", f.read())}
    return sorted(names)


def worker(name: str, repeats: int) -> None:
    """Run in a subprocess by section_flags, under its XLA_FLAGS: purejax and purejax-3d at config `name`,
    timed interleaved; prints one JSON line (ms, the first two losses, the kinds of library fusions)."""
    setup = Setup.make(name)
    step, hlo = build_with_hlo(setup.build, make_purejax)
    old, _ = build_with_hlo(setup.build, make_purejax_3d)
    losses = [float(step()) for _ in range(1)]  # the compiling call was the first; this is after one update
    ms = medians({"purejax": step, "purejax-3d": old}, setup, repeats)
    kinds = collections.Counter(re.findall(r'"kind":"(__\w+_fusion)"', hlo))
    print(json.dumps({"ms": ms, "losses": losses, "fusions": kinds, "dots": len(re.findall(r" dot\(", hlo))}))


def section_flags(configs, repeats) -> None:
    """Each of FLAGS in a fresh process (XLA_FLAGS is read once); default first and again last."""
    print(f"\nxla_cpu flags in this jaxlib: {', '.join(xla_cpu_flags())}")
    for name in configs:
        runs = {}
        for label, flags in [*FLAGS.items(), ("default, again", "")]:
            env = {**os.environ, "XLA_FLAGS": f"{flags} {DUMP_FLAGS}"}
            cmd = [sys.executable, "-m", "bench.gpt_anatomy", "--worker", name, "--repeats", str(repeats or 5)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                runs[label] = proc.stderr.strip().splitlines()[-1][:100]
            else:
                runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {name} {label}: {runs[label]}", flush=True)
        base = statistics.mean(runs[k]["ms"]["purejax"] for k in ("default", "default, again"))
        ref = runs["default"]["losses"][0]
        rows = []
        for label, run in runs.items():
            if isinstance(run, str):
                rows.append([label, FLAGS.get(label, "") or "(none)", "failed: " + run, "", "", "", ""])
                continue
            pj, old = run["ms"]["purejax"], run["ms"]["purejax-3d"]
            fusions = ", ".join(f"{n} {k.strip('_')}" for k, n in run["fusions"].items()) or "none"
            flags = f"`{FLAGS[label]}`" if FLAGS.get(label) else "(none)"
            rows.append(
                [
                    label,
                    flags,
                    f"{pj:.1f}",
                    f"{pj / base:.2f}",
                    f"{old:.1f}",
                    f"{old / pj:.2f}",
                    f"{run['losses'][0] - ref:+.1e}",
                    f"{fusions}; {run['dots']} dots",
                ]
            )
        print(f"\n### {name}: XLA flags (each in its own process; / default: against the mean of both default runs)")
        table(
            (
                "setting",
                "XLA_FLAGS",
                "purejax ms",
                "/ default",
                "purejax-3d ms",
                "3d / purejax",
                "loss - default's",
                "library fusions in the step",
            ),
            rows,
        )
