"""Chrome-trace timelines (open in Perfetto or chrome://tracing): one process per rank.

The file speaks Kineto's vocabulary where it can, so that `ringtree trace FILE` reads it like a
torch.profiler trace: `ProfilerStep#N` spans for the optimizer steps, `distributedInfo` and
`baseTimeNanoseconds` in the header (ts are microseconds after it), and a `ringtree` key that
tells this one-file-for-every-rank timeline from Kineto's one file per rank."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

THREADS = {"compute": 0, "comm": 1}  # thread ids in the trace: the training loop and the buckets


@dataclass(frozen=True)
class Event:
    """One span on one rank: `start` and `end` in seconds since the epoch."""

    name: str
    rank: int
    thread: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Collects one rank's spans; perf_counter timestamps are mapped to wall-clock time."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank, self.enabled = rank, enabled
        self.events: list[Event] = []
        self._offset = time.time() - time.perf_counter()

    def add(self, name: str, start: float, end: float, thread: str = "compute", **args: Any) -> None:
        """Record a span given in time.perf_counter() seconds."""
        if self.enabled:
            self.events.append(Event(name, self.rank, thread, start + self._offset, end + self._offset, args))

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), **args)


def chrome_trace(events: Sequence[Event], backend: str = "") -> dict[str, Any]:
    """The trace-event JSON object: complete ("X") events in microseconds, named processes and threads."""
    origin = math.floor(min((e.start for e in events), default=0.0))  # whole seconds: exact in ns
    out: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for thread, tid in THREADS.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
    for e in events:
        out.append(
            {
                "ph": "X",
                "cat": "user_annotation" if e.name.startswith("ProfilerStep#") else "ringtree",
                "name": e.name,
                "pid": e.rank,
                "tid": THREADS[e.thread],
                "ts": (e.start - origin) * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": e.args,
            }
        )
    ranks = sorted({e.rank for e in events})
    return {
        "schemaVersion": 1,
        "ringtree": {"format": 1, "ranks": ranks},
        "distributedInfo": {"backend": backend, "world_size": len(ranks)},
        "baseTimeNanoseconds": int(origin) * 10**9,
        "traceEvents": out,
        "displayTimeUnit": "ms",
    }


def write(path: str | Path, events: Sequence[Event], backend: str = "") -> None:
    """Write the Chrome trace atomically (temporary file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(chrome_trace(events, backend), f)
    os.replace(tmp, target)
