"""The reader of ringtree's own timeline (`ringtree train --trace FILE`): one Chrome trace for the
whole world, a process per rank (pid = rank), the training loop on thread 0 and the gradient
buckets' collectives on thread 1, `ProfilerStep#N` spans for the optimizer steps
(ringtree/train/trace.py writes it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ringtree.trace import intervals as iv
from ringtree.trace import names
from ringtree.trace.events import COMM, COMPUTE, Collective, RankTrace, Step, intervals
from ringtree.trace.kineto import nanoseconds, step_of

MARK = "ringtree"  # the top-level key that tells ringtree's timeline from a Kineto trace
COMPUTE_TID, COMM_TID = 0, 1


def is_timeline(doc: Mapping[str, Any]) -> bool:
    return isinstance(doc.get(MARK), dict)


def read(doc: Mapping[str, Any], path: str) -> list[RankTrace]:
    """One RankTrace per rank of the timeline."""
    base = int(doc.get("baseTimeNanoseconds") or 0)
    info = doc.get("distributedInfo") or {}
    by_rank: dict[int, list[tuple[int, int, int, str, dict[str, Any]]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("pid"), int):
            start = nanoseconds(e["ts"]) + base
            by_rank[e["pid"]].append(
                (start, start + nanoseconds(e["dur"]), e.get("tid", 0), e["name"], e.get("args") or {})
            )
    world = info.get("world_size") or len(by_rank)
    backend = str(info.get("backend") or "")
    return [_rank(path, rank, rows, world, backend) for rank, rows in sorted(by_rank.items())]


def _rank(
    path: str, rank: int, rows: list[tuple[int, int, int, str, dict[str, Any]]], world: int, backend: str
) -> RankTrace:
    steps = sorted(
        (
            Step(int(name.split("#", 1)[1]), s, e)
            for s, e, _, name, _ in rows
            if name.startswith("ProfilerStep#")
        ),
        key=lambda st: st.start,
    )
    starts = [st.start for st in steps]
    work = [r for r in rows if not r[3].startswith("ProfilerStep#")]
    # the loop's spans (backward) hold the waits for the buckets: compute is what is left outside
    # the collectives' spans, so the timeline's communication counts as exposed
    comm = iv.union(*_arrays([r for r in work if r[2] == COMM_TID]))
    comp = iv.difference(iv.union(*_arrays([r for r in work if r[2] == COMPUTE_TID])), comm)
    busy = [(int(s), int(e), COMPUTE, COMPUTE_TID, int(s)) for s, e in zip(*comp, strict=True)]
    calls = []
    for s, e, tid, name, args in work:
        if tid != COMM_TID:
            continue
        busy.append((s, e, COMM, COMM_TID, s))
        op = names.collective_op(name) or "all_reduce"
        nbytes = int(args.get("bytes", 0))
        dtype = str(args.get("dtype", ""))
        calls.append(
            Collective(op, "0", world, nbytes, dtype, s, e, s, -1, step_of(steps, starts, s), "timeline")
        )
    return RankTrace(
        path=f"{path}#rank{rank}",
        rank=rank,
        world_size=world,
        backend=backend or "gloo",
        device="cpu",
        busy=intervals(busy),
        collectives=calls,
        steps=steps,
        first=min(r[0] for r in rows),
        last=max(r[1] for r in rows),
    )


def _arrays(rows: list[tuple[int, int, int, str, dict[str, Any]]]) -> tuple[iv.Array, iv.Array]:
    import numpy as np

    a = np.array([(r[0], r[1]) for r in rows], dtype=np.int64).reshape(-1, 2)
    return a[:, 0].copy(), a[:, 1].copy()
