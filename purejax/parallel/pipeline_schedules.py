"""Pipeline schedules as plain data: a table whose row t, column s says what stage s does at time step t,
`("F", m)` (the forward of micro-batch m), `("B", m)` (its backward) or `None` (idle, the bubble).
purejax/parallel/pipeline.py executes any such table; this page builds, checks and measures them.

    table = one_f_one_b(n_stages=4, n_micro=4)
    check(table, n_stages=4, n_micro=4)   # every dependency holds, every op appears once
    bubble_fraction(table)                # 3/7: idle slots / all slots, (S-1)/(M+S-1)
    stored_activations(table)             # [4, 3, 2, 1]: micro-batches forwarded but not yet backwarded
    print(render(table))                  # the picture in docs/parallelism.md

Both schedules come from one greedy simulation in unit time steps (a forward and a backward take one step
each): at every step each stage picks, among the ops whose inputs have arrived, the one its policy prefers.
Micro-batches go through a stage in order; F(s, m) needs F(s-1, m) done at an earlier step (its input is
sent by `ppermute` at the end of that step), B(s, m) needs F(s, m) and B(s+1, m) done earlier.

- GPipe (Huang et al. 2019): every forward first, then the backwards. Stage s stores the inputs of all M
  micro-batches before its first backward.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, fig. 4): stage s runs at most S - s forwards ahead of its
  backwards, then alternates one backward, one forward. Same length, 2 (M + S - 1) steps, so the same
  bubble, but at most S stored activations per stage whatever M.

Bubble. Each stage works 2M of the 2 (M + S - 1) steps, so the idle fraction is (S - 1) / (M + S - 1)
(GPipe paper, sec. 2.2): it falls only with more micro-batches per step.
"""

from collections.abc import Callable

import numpy as np

Op = tuple[str, int] | None
Table = tuple[tuple[Op, ...], ...]
IDLE, FORWARD, BACKWARD = 0, 1, 2


def _simulate(n_stages: int, n_micro: int, pick: Callable[[int, bool, bool, int, int], str | None]) -> Table:
    """Step by step, each stage s does `pick(s, forward_ready, backward_ready, forwards_done, backwards_done)`
    ("F", "B" or None) on its next micro-batch of that kind."""
    for name, value in (("n_stages", n_stages), ("n_micro", n_micro)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline_schedules: {name} must be a positive int, got {value!r}")
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> the step it ran
    n_f, n_b = [0] * n_stages, [0] * n_stages
    rows = []
    while sum(n_b) < n_stages * n_micro:
        t, row = len(rows), []
        for s in range(n_stages):
            m_f, m_b = n_f[s], n_b[s]
            f_ready = m_f < n_micro and (s == 0 or done.get(("F", s - 1, m_f), t) < t)
            b_ready = m_b < m_f and done[("F", s, m_b)] < t
            b_ready = b_ready and (s == n_stages - 1 or done.get(("B", s + 1, m_b), t) < t)
            kind = pick(s, f_ready, b_ready, m_f, m_b)
            if kind is None:
                row.append(None)
                continue
            m = m_f if kind == "F" else m_b
            done[(kind, s, m)] = t
            (n_f if kind == "F" else n_b)[s] += 1
            row.append((kind, m))
        rows.append(tuple(row))
    return tuple(rows)


def gpipe(n_stages: int, n_micro: int) -> Table:
    """GPipe: a stage forwards whenever it can, and starts its backwards once all M forwards are done."""

    def pick(s, f_ready, b_ready, n_f, n_b):
        return "F" if f_ready else "B" if b_ready and n_f == n_micro else None

    return _simulate(n_stages, n_micro, pick)


def one_f_one_b(n_stages: int, n_micro: int) -> Table:
    """1F1B: a backward whenever one is ready, else a forward while fewer than S - s are in flight."""

    def pick(s, f_ready, b_ready, n_f, n_b):
        return "B" if b_ready else "F" if f_ready and n_f - n_b < n_stages - s else None

    return _simulate(n_stages, n_micro, pick)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def times(table: Table) -> dict[tuple[str, int, int], int]:
    """{(kind, stage, micro-batch): the step it runs}."""
    return {(op[0], s, op[1]): t for t, row in enumerate(table) for s, op in enumerate(row) if op is not None}


def check(table: Table, n_stages: int, n_micro: int) -> None:
    """Raise ValueError naming the first op that is missing, repeated or runs before its inputs arrive."""
    if any(len(row) != n_stages for row in table):
        raise ValueError(f"schedule: every row must have one entry per stage ({n_stages})")
    ops = [(op[0], s, op[1]) for row in table for s, op in enumerate(row) if op is not None]
    at = times(table)
    want = {(k, s, m) for k in "FB" for s in range(n_stages) for m in range(n_micro)}
    if len(ops) != len(set(ops)) or set(ops) != want:
        extra, missing = sorted(set(ops) - want), sorted(want - set(ops))
        raise ValueError(f"schedule: each (F|B, stage, micro-batch) must run once; extra {extra}, missing {missing}")
    for kind, s, m in sorted(want):
        needs = [("F", s - 1, m)] if kind == "F" and s > 0 else []
        if kind == "B":
            needs = [("F", s, m)] + ([("B", s + 1, m)] if s < n_stages - 1 else [])
        late = [need for need in needs if at[need] >= at[(kind, s, m)]]
        if late:
            raise ValueError(f"schedule: {kind}({m}) on stage {s} at step {at[(kind, s, m)]} runs before {late}")


def micro_batches(table: Table) -> int:
    """How many micro-batches the table runs (M)."""
    return 1 + max(op[1] for row in table for op in row if op is not None)


def bubble_fraction(table: Table) -> float:
    """Idle slots over all slots (steps x stages)."""
    slots = [op for row in table for op in row]
    return sum(op is None for op in slots) / len(slots)


def stored_activations(table: Table) -> list[int]:
    """Per stage, the most micro-batches forwarded but not yet backwarded at once: the activations it keeps."""
    n_stages = len(table[0])
    most = [0] * n_stages
    for s in range(n_stages):
        live = 0
        for row in table:
            live += {"F": 1, "B": -1}.get(row[s][0], 0) if row[s] else 0
            most[s] = max(most[s], live)
    return most


def buffer_slots(table: Table) -> int:
    """The fewest buffer slots K such that, on every stage, micro-batch m kept in slot m % K is never
    overwritten before its backward reads it: an input is held from the step after the previous stage's F
    (or its own F, on stage 0) to its B, a gradient from the step after the next stage's B to its B."""
    at, n_stages, n_micro = times(table), len(table[0]), micro_batches(table)
    spans = []  # (stage, buffer, first step held, last step read, micro-batch)
    for s in range(n_stages):
        for m in range(n_micro):
            spans.append((s, "x", at[("F", s, m)] if s == 0 else at[("F", s - 1, m)] + 1, at[("B", s, m)], m))
            if s < n_stages - 1:
                spans.append((s, "dy", at[("B", s + 1, m)] + 1, at[("B", s, m)], m))
    for k in range(1, n_micro + 1):
        clash = any(
            a[:2] == b[:2] and a[4] % k == b[4] % k and a[4] != b[4] and a[2] <= b[3] and b[2] <= a[3]
            for a in spans
            for b in spans
        )
        if not clash:
            return k
    return n_micro


def as_arrays(table: Table) -> tuple[np.ndarray, np.ndarray]:
    """(kind, micro-batch), each an int array (steps, stages); kind is IDLE, FORWARD or BACKWARD."""
    kind = np.array([[{None: IDLE, "F": FORWARD, "B": BACKWARD}[op and op[0]] for op in row] for row in table])
    micro = np.array([[op[1] if op else 0 for op in row] for row in table])
    return kind.astype(np.int32), micro.astype(np.int32)


def render(table: Table) -> str:
    """Time steps across, stages down: `F3` the forward of micro-batch 3, `B3` its backward, `.` idle."""
    width = 1 + len(str(max((op[1] for row in table for op in row if op), default=0)))
    lines = []
    for s in range(len(table[0])):
        cells = [(f"{row[s][0]}{row[s][1]}" if row[s] else ".").ljust(width) for row in table]
        lines.append(f"stage {s}: " + " ".join(cells).rstrip())
    return "\n".join(lines)
