"""A CPU run's busy time (gloo): compute is the training thread's operators, communication the
collectives' work (`gloo:*` on gloo's threads, `ringtree:*` wherever ringtree's schedules ran)
and the host ops that start them; a collective inside one of ringtree's is part of it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from ringtree.trace import intervals as iv
from ringtree.trace import names, sizes
from ringtree.trace.events import COMM, COMPUTE, Collective, Intervals, Step, intervals

HostRow = tuple[int, int, Any, str, str, dict[str, Any] | None]  # start, end, thread, name, cat, data
_WORK = ("gloo:", "ringtree:")  # where a collective's bytes move (and its waits)
_COMM_HOST = ("c10d::", "nccl:", "record_param_comms")


def cpu_busy(
    host: list[HostRow], steps: list[Step], main: Any, world: int | None, groups: dict[str, list[int]]
) -> tuple[Intervals, list[Collective]]:
    """(busy intervals, collectives) of a run without kernels."""
    if main is None:
        counts = Counter(tid for _, _, tid, _, cat, _ in host if cat == "cpu_op")
        main = counts.most_common(1)[0][0] if counts else None
    work = [r for r in host if r[3].startswith(_WORK)]
    comm_host = [r for r in host if r[2] == main and r[3].startswith(_COMM_HOST)]
    ops = [r for r in host if r[2] == main and r[4] == "cpu_op" and not r[3].startswith(_COMM_HOST)]
    on_main = [r for r in work + comm_host if r[2] == main]
    compute = iv.difference(_union(ops), _union(on_main))
    rows = [(int(s), int(e), COMPUTE, _lane(main), int(s)) for s, e in zip(*compute, strict=True)]
    rows += [(s, e, COMM, _lane(tid), s) for s, e, tid, *_ in work + comm_host]
    return intervals(rows), _collectives(work, steps, world or 1, _default_group(groups, world))


def _collectives(work: list[HostRow], steps: list[Step], world: int, group: str) -> list[Collective]:
    from ringtree.trace.kineto import step_of

    starts = [s.start for s in steps]
    outer = [(s, e, tid) for s, e, tid, name, *_ in work if name.startswith("ringtree:")]
    out = []
    for start, end, tid, name, _cat, data in work:
        op = names.collective_op(name)
        if op is None or data is None:
            continue
        if name.startswith("gloo:") and any(s <= start and end <= e and t == tid for s, e, t in outer):
            continue  # the point-to-point transfers of one of ringtree's schedules
        nbytes, dtype, size = sizes.from_host_ops(op, [(name, data)], world)
        step = step_of(steps, starts, start)
        out.append(Collective(op, group, size, nbytes, dtype, start, end, start, -1, step, "host op"))
    return out


def _union(rows: list[HostRow]) -> iv.Union:
    a = np.array([(r[0], r[1]) for r in rows], dtype=np.int64).reshape(-1, 2)
    return iv.union(a[:, 0].copy(), a[:, 1].copy())


def _default_group(groups: dict[str, list[int]], world: int | None) -> str:
    whole = [name for name, ranks in groups.items() if world and len(ranks) == world]
    return whole[0] if whole else "0"


def _lane(tid: Any) -> int:
    return tid if isinstance(tid, int) else hash(tid) & 0x7FFFFFFF
