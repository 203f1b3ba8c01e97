"""The reader of Kineto's Chrome-trace JSON (torch.profiler's `export_chrome_trace`, one file per
rank): one pass over `traceEvents` keeps, per event, only what the analysis reads.

Format variants it handles: timestamps as integer epoch microseconds (before kineto#910) or as
fractional microseconds after `baseTimeNanoseconds`; collectives described on their kernels
(`Collective name`, `In msg nelems`, ...) or only by the host ops around the launch (c10d's op
and NCCL's record function with `Input Dims`); NCCL <= 2.18 and >= 2.19 kernel names; GPU runs
(kernels on streams) and CPU runs (gloo: operators on the main thread, `gloo:*` on its threads).
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from ringtree.trace import names, sizes
from ringtree.trace.cpu import cpu_busy
from ringtree.trace.events import COMM, Collective, RankTrace, Step, intervals

_STEP = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
_HOST_DATA = ("Input Dims", "Input type")


def read(doc: Mapping[str, Any], path: str, rank: int) -> RankTrace:
    """One rank's RankTrace from its parsed trace document."""
    info = doc.get("distributedInfo") or {}
    base = int(doc.get("baseTimeNanoseconds") or 0)
    world = _world(info)
    p = _Pass(base)
    for e in doc["traceEvents"]:
        if isinstance(e, dict) and e.get("ph") == "X":
            p.add(e)
    groups = _groups(info)
    steps, main = _steps(p.steps)
    if p.kernels:
        busy = intervals([(s, e, k, lane, p.launch_of(c)) for s, e, k, lane, c, _, _ in p.kernels])
        collectives = _gpu_collectives(p, world, steps)
        device = "gpu"
    else:
        busy, collectives = cpu_busy(p.host, steps, main, world, groups)
        device = "cpu"
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world,
        backend=str(info.get("backend") or ("gloo" if device == "cpu" else "nccl")),
        device=device,
        busy=busy,
        collectives=collectives,
        steps=steps,
        first=p.first,
        last=p.last,
        groups=groups,
    )


class _Pass:
    """What one pass over the events keeps."""

    def __init__(self, base: int) -> None:
        self.base = base
        # kernels: (start, end, kind, stream, correlation, name, collective args or None)
        self.kernels: list[tuple[int, int, int, int, int, str, dict[str, Any] | None]] = []
        self.launches: dict[int, tuple[int, Any]] = {}  # correlation -> (host start, thread)
        self.host: list[tuple[int, int, Any, str, str, dict[str, Any] | None]] = []  # cpu runs, comm ops
        self.steps: list[tuple[int, int, int, Any]] = []  # (number, start, end, thread)
        self.first, self.last = 1 << 62, -(1 << 62)

    def ns(self, us: Any) -> int:
        return nanoseconds(us) + self.base

    def add(self, e: dict[str, Any]) -> None:
        cat, ts, dur = e.get("cat"), e.get("ts"), e.get("dur")
        if cat is None or ts is None or dur is None or cat == "Trace":
            return
        start = self.ns(ts)
        end = start + nanoseconds(dur)
        self.first, self.last = min(self.first, start), max(self.last, end)
        name = str(e.get("name", ""))
        args = e.get("args") or {}
        stream, corr = args.get("stream", -1), args.get("correlation", -1)
        if isinstance(stream, int) and stream >= 0 and isinstance(corr, int) and corr >= 0:
            coll = args if "Collective name" in args else None
            kind = names.kernel_kind(name, cat, coll is not None)
            self.kernels.append((start, end, kind, stream, corr, name, coll))
            return
        tid = e.get("tid")
        if isinstance(corr, int) and corr >= 0:
            self.launches[corr] = (start, tid)
        if cat in ("cpu_op", "user_annotation", "Operator", "python_function") or name.startswith("gloo:"):
            m = _STEP.match(name)
            if m:
                self.steps.append((int(m.group(1)), start, end, tid))
            elif cat != "python_function":
                data = (
                    {k: args[k] for k in _HOST_DATA if k in args} if names.is_host_collective(name) else None
                )
                self.host.append((start, end, tid, name, str(cat), data))

    def launch_of(self, correlation: int) -> int:
        found = self.launches.get(correlation)
        return -1 if found is None else found[0]


def nanoseconds(us: Any) -> int:
    """Microseconds (an int, or a float with nanosecond decimals) as integer nanoseconds, exactly:
    epoch microseconds times 1000 would lose precision in a float."""
    if isinstance(us, int):
        return us * 1000
    whole = int(us)
    return whole * 1000 + round((float(us) - whole) * 1000)


def _world(info: Mapping[str, Any]) -> int | None:
    size = info.get("world_size")
    return size if isinstance(size, int) and size > 0 else None


def _groups(info: Mapping[str, Any]) -> dict[str, list[int]]:
    out = {}
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and "pg_name" in pg:
            out[str(pg["pg_name"])] = sizes.group_ranks(pg.get("ranks"))
    return out


def _steps(found: list[tuple[int, int, int, Any]]) -> tuple[list[Step], Any]:
    """The ProfilerStep windows on the thread that has most of them (the training loop's), and
    that thread."""
    if not found:
        return [], None
    main = Counter(t for *_, t in found).most_common(1)[0][0]
    seen: dict[int, Step] = {}
    for number, start, end, tid in found:
        if tid == main and number not in seen:
            seen[number] = Step(number, start, end)
    return sorted(seen.values(), key=lambda s: s.start), main


def step_of(steps: list[Step], starts: list[int], t: int) -> int:
    """The number of the step whose window holds t, or -1."""
    k = bisect.bisect_right(starts, t) - 1
    return steps[k].number if k >= 0 and t < steps[k].end else -1


def _gpu_collectives(p: _Pass, world: int | None, steps: list[Step]) -> list[Collective]:
    """Every communication kernel as a Collective, described by its own args, else by the host
    ops around its launch, else by its name."""
    host = _HostCollectives(p.host)
    starts = [s.start for s in steps]
    out = []
    for start, end, kind, _stream, corr, name, coll in p.kernels:
        if kind != COMM:
            continue
        launch = p.launches.get(corr)
        at = launch[0] if launch else -1
        step = step_of(steps, starts, at if at >= 0 else start)
        if coll is not None:
            nbytes, dtype, size, group, seq = sizes.from_kernel_args(coll)
            op = names.collective_op(str(coll["Collective name"])) or names.kernel_op(name) or "send_recv"
            out.append(Collective(op, group, size, nbytes, dtype, start, end, at, seq, step, "kernel args"))
            continue
        records = host.around(*launch) if launch else []
        found = next((o for r in records if (o := names.collective_op(r[0]))), None)
        if found is not None:
            op = found
            nbytes, dtype, size = sizes.from_host_ops(op, records, world or 1)
            group = "0" if world is None or size == world else f"unnamed-{size}"  # old traces name none
            out.append(Collective(op, group, size, nbytes, dtype, start, end, at, -1, step, "host op"))
            continue
        op = names.kernel_op(name) or "send_recv"
        dtype = sizes.from_kernel_name(name)
        out.append(Collective(op, "0", world or 1, 0, dtype, start, end, at, -1, step, "kernel name"))
    return out


class _HostCollectives:
    """The host's collective ops per thread, to find the ones around a kernel's launch."""

    def __init__(self, host: list[tuple[int, int, Any, str, str, dict[str, Any] | None]]) -> None:
        by_thread: dict[Any, list[tuple[int, int, str, dict[str, Any]]]] = defaultdict(list)
        for start, end, tid, name, _cat, data in host:
            if data is not None:
                by_thread[tid].append((start, end, name, data))
        self.ops = {t: sorted(v) for t, v in by_thread.items()}
        self.starts = {t: [o[0] for o in v] for t, v in self.ops.items()}

    def around(self, t: int, tid: Any) -> list[tuple[str, dict[str, Any]]]:
        """(name, args) of the collective ops enclosing time t on the thread, innermost first."""
        ops, starts = self.ops.get(tid, []), self.starts.get(tid, [])
        k = bisect.bisect_right(starts, t)
        found = []
        for start, end, name, data in reversed(ops[max(0, k - 8) : k]):  # nested ops start just before
            if start <= t < end:
                found.append((name, data))
        return found
