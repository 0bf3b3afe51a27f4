"""purejax.parallel.describe: each device's slice, as printed, is the data jax placed on that device."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from purejax import parallel

ROOT = Path(__file__).resolve().parents[3]

# Run with 4 simulated devices (XLA_FLAGS before jax starts; this process has one): place real data on a
# 2 x 2 mesh, then check every d<id>[slices] that describe prints against the shard jax put on device <id>.
CHILD = r"""
import os, re
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from purejax import parallel

mesh = parallel.make_mesh(dp=2, tp=2)
shapes = {"w1": (4, 8), "w2": (8, 2), "b": (6,)}
specs = {"w1": P("data", "model"), "w2": P("model", "data"), "b": P()}
data = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in shapes.items()}
placed = {k: jax.device_put(data[k], NamedSharding(mesh, specs[k])) for k in data}
text = parallel.describe(placed)
abstract = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}
assert parallel.describe(abstract, specs=specs, mesh=mesh) == text, "from specs != from placed arrays"
checked = 0
for line in text.splitlines():
    name = line.split()[0]
    pieces = re.findall(r"d(\d+)\[([^\]]*)\]", line)
    assert sorted(int(d) for d, _ in pieces) == [0, 1, 2, 3], line
    for device, slices in pieces:
        index = tuple(slice(*map(int, s.split(":"))) for s in slices.split(", "))
        shard = next(s for s in placed[name].addressable_shards if s.device.id == int(device))
        assert np.array_equal(data[name][index], np.asarray(shard.data)), (line, device)
        checked += 1
print(text)
print("checked", checked)
"""


def test_each_printed_slice_is_the_data_on_that_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "checked 12" in run.stdout  # 3 leaves x 4 devices
    lines = run.stdout.splitlines()
    assert re.match(r"w1 \(4, 8\) P\('data', 'model'\) +d0\[0:2, 0:4\]  d1\[0:2, 4:8\]  d2\[2:4, 0:4\]", lines[1])
    assert lines[1].endswith("(25% each)") and lines[0].startswith("b (6,) P()") and lines[0].endswith("(100% each)")


def test_one_device_and_nested_paths():
    mesh = parallel.make_mesh(dp=1, tp=1)
    tree = {"layer": {"w": jnp.zeros((2, 3))}, "scale": jnp.zeros(())}
    text = parallel.describe(tree, specs={"layer": {"w": P(None, "model")}, "scale": P()}, mesh=mesh)
    assert text.splitlines() == [
        "layer.w (2, 3) P(None, 'model')  d0[0:2, 0:3]  (100% each)",
        "scale () P()                     d0[]  (100% each)",
    ]


def test_errors_name_what_to_do():
    mesh = parallel.make_mesh(dp=1, tp=1)
    with pytest.raises(ValueError, match=r"without the mesh .* pass mesh="):
        parallel.describe({"w": jnp.zeros(2)}, specs={"w": P()})
    with pytest.raises(ValueError, match=r"shape \(2,\) has sharding None, not a NamedSharding; place the tree"):
        parallel.describe({"w": np.zeros(2)})
    with pytest.raises(
        ValueError, match=r"specs PyTreeDef\(\{'a': \*\}\) do not match the tree PyTreeDef\(\{'a': \*, 'b': \*\}\)"
    ):
        parallel.describe({"a": jnp.zeros(2), "b": jnp.zeros(2)}, specs={"a": P()}, mesh=mesh)
    placed = jax.device_put(jnp.zeros(2), NamedSharding(mesh, P()))
    assert parallel.describe({"w": placed}) == "w (2,) P()  d0[0:2]  (100% each)"
