"""Reading a run's trace files, one process per file (in parallel, each holding one file at a
time), and refusing a set that is not one run: two files claiming one rank, different world
sizes, traces that do not overlap in time."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ringtree.trace import files, kineto, timeline
from ringtree.trace.events import RankTrace

SKEW_NS = 60 * 10**9  # hosts' clocks may disagree (NTP) by this much and still be one run


def read_file(path: Path) -> list[RankTrace]:
    """The ranks one file holds (a Kineto trace holds one; ringtree's timeline may hold all)."""
    doc = files.load(path)
    if timeline.is_timeline(doc):
        return timeline.read(doc, str(path))
    return [kineto.read(doc, str(path), files.rank_of(doc, path))]


def read_all(paths: list[Path], workers: int | None = None) -> list[RankTrace]:
    """Every rank's trace, sorted by rank (ValueError naming the file for any problem)."""
    found = files.discover(paths)
    n = min(len(found), workers or os.cpu_count() or 1)
    if n <= 1:
        traces = [t for p in found for t in read_file(p)]
    else:
        with ProcessPoolExecutor(max_workers=n, mp_context=_context()) as pool:
            traces = [t for ts in pool.map(read_file, found) for t in ts]
    check_one_run(traces)
    return sorted(traces, key=lambda t: t.rank)


def _context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def check_one_run(traces: list[RankTrace]) -> None:
    sized = [t for t in traces if t.world_size is not None]
    for t in sized[1:]:
        if t.world_size != sized[0].world_size:
            raise ValueError(
                f"{sized[0].path} is from a world of {sized[0].world_size} ranks and {t.path} from one of "
                f"{t.world_size}: files from different runs; pass the files of one run"
            )
    for t in sized:
        assert t.world_size is not None
        if t.rank >= t.world_size:
            raise ValueError(
                f"{t.path} claims rank {t.rank} of a world of {t.world_size}; the file is damaged"
            )
    by_rank: dict[int, RankTrace] = {}
    for t in traces:
        if t.rank in by_rank:
            raise ValueError(
                f"{by_rank[t.rank].path} and {t.path} both hold rank {t.rank}; "
                "pass one file per rank of one run"
            )
        by_rank[t.rank] = t
    earliest = min(traces, key=lambda t: t.last)
    for t in traces:
        if t.first > earliest.last + SKEW_NS:
            raise ValueError(
                f"{earliest.path} ends before {t.path} begins: files from different runs (or different "
                "profiling windows); pass the files of one run"
            )
