"""Collectives of a compiled XLA program, counted as one device executes them in one run: an op inside a while
loop's body counts once per iteration (the loop's known_trip_count; loops nest: the micro-batch scan holds
the layer scan), and each op is attributed to the mesh axes its replica groups span.

    counts = executed_collectives(compiled.as_text(), mesh_shape={"data": 4, "model": 2})
    counts[("all-reduce", ("data",))]       # {"ops": 3, "elements": 4099}: ops run, elements moved per device

Devices are numbered as `purejax.parallel.make_mesh` lays them out (row-major over the mesh axes), which is
the numbering the replica groups use inside `shard_map`; newer XLA names the mesh axes of a group instead.
"""

import re
from collections import defaultdict
from collections.abc import Mapping

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$")
_OP = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(KINDS) + r")(?:-start)?\(")
_CALLS = re.compile(r"(body|calls|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its lines}, and the entry computation's name."""
    out, name, entry = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(1)
            out[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif name is not None:
            out[name].append(line)
    return out, entry


def _multiplicity(computations: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    times: dict[str, int] = defaultdict(int)

    def visit(name: str, n: int) -> None:
        times[name] += n
        for line in computations.get(name, ()):
            trips = re.search(r"known_trip_count\":\{\"n\":\"(\d+)", line)
            for key, value in _CALLS.findall(line):
                factor = int(trips.group(1)) if key == "body" and trips else 1
                if key == "body" and not trips:
                    raise ValueError(f"a while loop without a known trip count: {line[:200]}")
                for callee in re.findall(r"%[\w.\-]+", value):
                    visit(callee, n * factor)

    visit(entry, 1)
    return times


def _groups(line: str) -> np.ndarray | None:
    """The replica groups of a collective as a (groups, size) array of device numbers (None: all devices),
    from XLA's list (`{{0,1},{2,3}}`) or iota form (`[2,4]<=[4,2]T(1,0)`)."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return np.array([[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        n_groups, size, dims, perm = iota.groups()
        devices = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
        if perm:
            devices = devices.transpose([int(p) for p in perm.split(",")])
        return devices.reshape(int(n_groups), int(size))
    return None


def _axes(line: str, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective's replica groups span: named (newer XLA prints `mesh['data'=4,'model'=2]
    {'model'}`), or those along which the devices of one group differ."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    named = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
    if named:
        return tuple(n for n in names if f"'{n}'" in named.group(1))
    groups = _groups(line)
    if groups is None:
        return tuple(n for n, s in zip(names, sizes) if s > 1)
    coords = np.stack(np.unravel_index(groups[0], sizes), axis=-1)  # (group size, n_axes)
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)


def executed_collectives(hlo: str, mesh_shape: Mapping[str, int]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """{(kind, axes): {"ops": executed ops, "elements": elements of their results, summed}} per device."""
    computations, entry = _computations(hlo)
    times = _multiplicity(computations, entry)
    out: dict = defaultdict(lambda: {"ops": 0, "elements": 0})
    for name, lines in computations.items():
        for line in lines:
            op = _OP.search(line)
            if op is None or times.get(name, 0) == 0:
                continue
            shapes = re.findall(r"\[([\d,]*)\]", op.group(1))
            elements = sum(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in shapes)
            entry_ = out[(op.group(2), _axes(line, mesh_shape))]
            entry_["ops"] += times[name]
            entry_["elements"] += times[name] * elements
    return dict(out)
