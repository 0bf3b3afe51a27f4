"""The device mesh: a (data, model) grid of devices, with a context axis for context parallelism and an
outer pipe axis for pipeline parallelism, and `MeshAxes`, the names a model runs under.

    mesh = make_mesh(dp=4, tp=2)               # 8 devices: 4 data-parallel groups of 2 tensor-parallel ones
    axes = MeshAxes.of(mesh, fsdp=False)       # MeshAxes(data="data", model="model", fsdp=False)
    logits = gpt_parallel.apply(params, idx, config, axes=axes)   # inside jax.shard_map over `mesh`

Axis types. A mesh axis is Auto, Explicit or Manual (`jax.sharding.AxisType`); `jax.make_mesh` defaults to
Explicit since jax 0.7 and to Auto before, so the type is always passed here. We use Auto: every computation
runs inside `shard_map`, where the axes are Manual whatever their type, so the type only matters for code
outside it (the training loop, evaluation on gathered params, checkpoint restore), and there Auto lets XLA
place any operation on sharded arrays, where Explicit would ask for an output sharding on every matmul or
reshape that mixes sharded dimensions.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

DATA = "data"  # the batch is split over this axis (data parallelism; FSDP also splits the params over it)
MODEL = "model"  # heads, MLP units and the vocabulary are split over this axis (Megatron tensor parallelism)
CONTEXT = "context"  # the sequence is split over this axis (ring attention, purejax/parallel/ring_attention.py)
PIPE = "pipe"  # the layers are split over this axis into stages (purejax/parallel/pipeline.py)


def make_mesh(dp: int, tp: int, devices: Sequence[Any] | None = None, *, cp: int = 1, pp: int = 1) -> jax.sharding.Mesh:
    """A (dp, tp) mesh with axes (DATA, MODEL) over `devices` (default: all of them, `jax.devices()`); with
    `cp` > 1 a CONTEXT axis between them, with `pp` > 1 a PIPE axis before them: (PIPE, DATA, CONTEXT, MODEL)
    at most. An axis of size 1 other than DATA and MODEL is left out.

    Neighbouring devices share a data group (the model axis varies fastest): on a GPU host they are the ones
    with the fastest links, and tensor parallelism communicates the most (every block, forward and backward);
    the ring of context parallelism comes next (n-1 block transfers per attention layer). The pipe axis is
    the outermost: a stage sends one micro-batch's activations to the next once per schedule step, the least
    traffic of all, so stages may sit on different hosts."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("dp", dp), ("tp", tp), ("cp", cp), ("pp", pp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {size!r}")
    if pp * dp * cp * tp != len(devices):
        sizes = (f"pp={pp} x " if pp > 1 else "") + f"dp={dp} x tp={tp}" + (f" x cp={cp}" if cp > 1 else "")
        raise ValueError(
            f"make_mesh: {sizes} = {pp * dp * cp * tp} devices, but {len(devices)} are given "
            f"({devices[0].platform if devices else 'none'}); pick sizes whose product is {len(devices)}"
            + ("" if len(devices) > 1 else "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8")
        )
    axes = [(PIPE, pp), (DATA, dp), (CONTEXT, cp), (MODEL, tp)]
    names, shape = zip(*[(name, size) for name, size in axes if size > 1 or name in (DATA, MODEL)])
    grid = np.array(devices, dtype=object).reshape(shape)
    return jax.sharding.Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def parse_mesh(text: str) -> tuple[int, int]:
    """`(dp, tp)` from a command-line string such as "dp=4,tp=2" (a missing one is 1: "tp=8" is (1, 8))."""
    sizes = {"dp": 1, "tp": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"parse_mesh: cannot read {part!r} in {text!r}; expected e.g. 'dp=4,tp=2' (positive ints)")
        sizes[name.strip()] = int(value)
    return sizes["dp"], sizes["tp"]


@dataclass(frozen=True)
class MeshAxes:
    """How a model runs: the mesh axes it is split over, as seen from inside `shard_map`. Frozen and
    hashable (a static argument); `MeshAxes()` is one device, the model's plain single-device code.

    Arguments:
        data: the axis the batch is split over (None: no data parallelism). The loss is averaged over it;
            the gradients are summed over it by the training step (`sharded_train_step`), once per step.
        model: the axis heads, MLP units and vocabulary are split over (None: no tensor parallelism).
        fsdp: params (and so optimizer state) are also split over `data` at rest and gathered before use
            (ZeRO-3); needs `data`.
        context: the axis the sequence is split over (None: no context parallelism); attention runs as a
            ring over it and the loss is averaged over it too.
        pipe: the axis the layers are split over into stages (None: no pipeline parallelism); the model then
            runs as a pipeline (purejax/parallel/pipeline.py).
        sequence_parallel: Megatron sequence parallelism (purejax/parallel/sequence.py): between the
            tensor-parallel regions the sequence is split over `model`; needs `model`, not with `context`.
        ep: expert parallelism (purejax/parallel/experts.py): mixture-of-experts layers' experts split over
            `data`, tokens sent to them by all_to_all; needs `data`.
    """

    data: str | None = None
    model: str | None = None
    fsdp: bool = False
    context: str | None = None
    pipe: str | None = None
    sequence_parallel: bool = False
    ep: bool = False

    def __post_init__(self):
        if self.ep and self.data is None:
            raise ValueError(
                "MeshAxes: ep=True splits the experts over the data axis, so it needs data=<axis name> "
                "(a mesh with dp >= 2)"
            )
        if self.sequence_parallel and (self.model is None or self.context is not None):
            raise ValueError(
                "MeshAxes: sequence_parallel=True splits the sequence over the tensor-parallel axis, "
                f"so it needs model=<axis name> and no context axis, got {self}"
            )
        if self.fsdp and self.data is None:
            raise ValueError("MeshAxes: fsdp=True splits params over the data axis, so it needs data=<axis name>")
        named = [axis for axis in (self.data, self.model, self.context, self.pipe) if axis is not None]
        if len(set(named)) != len(named):
            raise ValueError(f"MeshAxes: data, model, context and pipe must be different mesh axes, got {named}")

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh, *, fsdp: bool = False, sp: bool = False, ep: bool = False) -> "MeshAxes":
        """The axes of a `make_mesh` mesh, leaving out those of size 1: a 1 x 8 mesh is pure tensor
        parallelism, with no data-parallel collectives at all. FSDP needs at least 2 data shards (else an error)."""
        sizes = dict(mesh.shape)
        missing = [name for name in (DATA, MODEL) if name not in sizes]
        if missing:
            raise ValueError(f"MeshAxes.of: the mesh has axes {tuple(sizes)}, not {missing}; build it with make_mesh")
        data = DATA if sizes[DATA] > 1 else None
        if fsdp and data is None:
            raise ValueError(
                f"MeshAxes.of: fsdp shards params over the data axis, which has 1 device on this "
                f"mesh {sizes}; use a mesh with dp >= 2 or fsdp=False"
            )
        context = CONTEXT if sizes.get(CONTEXT, 1) > 1 else None
        pipe = PIPE if sizes.get(PIPE, 1) > 1 else None
        if sp and sizes[MODEL] == 1:
            raise ValueError(
                f"MeshAxes.of: sequence parallelism (sp) splits the sequence over the model axis, which "
                f"has 1 device on this mesh {sizes}; use a mesh with tp >= 2 or sp=False"
            )
        model = MODEL if sizes[MODEL] > 1 else None
        return cls(data=data, model=model, fsdp=fsdp, context=context, pipe=pipe, sequence_parallel=sp, ep=ep)
