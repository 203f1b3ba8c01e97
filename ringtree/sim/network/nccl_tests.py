"""Reading the standard output of nccl-tests' all_reduce_perf and alltoall_perf: sizes, times, the layout.

The layout comes from the `Using devices` block (one `Rank r ... on HOST device d` line per rank,
with or without a leading `#` and a `Group` column); the table's columns from its header line,
so that old logs (`size count type time algbw busbw error ...`) and new ones (with `redop`,
`root` and `#wrong`) read alike. `NCCL_DEBUG=INFO` lines between rows, and the header and device
block repeated by several mpirun ranks, are skipped. A log holds one run per table; a table that
does not end with nccl-tests' `# Avg bus bandwidth` line was cut short and is refused. An
alltoall_perf table is known by its `# Collective test starting: alltoall_perf` line (its rows
look like all_gather_perf's, so a table without that line and without a reduction is refused).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_RANK = re.compile(
    r"^\s*#?\s*Rank\s+(?P<rank>\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(?P<host>\S+)"
    r"\s+device\s+\d+\s+\[[^\]]*\]\s*(?P<gpu>.*?)\s*$"
)
_COLLECTIVE = re.compile(r"Collective test starting:\s*(\S+)")
_NCCL_LOG = re.compile(r"\bNCCL (INFO|WARN|TRACE)\b")
_END = "Avg bus bandwidth"
# nccl-tests program -> the collective its rows measure (`measurements()`' "collective")
PROGRAMS = {"all_reduce_perf": "all_reduce", "alltoall_perf": "all_to_all"}


class NcclTestsError(ValueError):
    """A log that is not (complete) nccl-tests output; the message names the file and line."""


@dataclass(frozen=True)
class NcclRow:
    """One size of the table: out-of-place and in-place times in microseconds."""

    nbytes: int
    count: int
    dtype: str
    out_of_place_us: float
    in_place_us: float
    redop: str = "sum"


@dataclass
class NcclRun:
    """One all_reduce_perf or alltoall_perf table with the rank layout it ran on."""

    path: str
    line: int  # where the table starts
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> host name
    gpu: str = ""
    rows: list[NcclRow] = field(default_factory=list)
    collective: str = "all_reduce"

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def nodes(self) -> int:
        return len(set(self.hosts.values()))

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def measurements(self) -> list[dict[str, Any]]:
        """Rows in the shape `ringtree calibrate` fits: one per size, the mean of the two times."""
        return [
            {
                "source": "nccl-tests",
                "file": self.path,
                "collective": self.collective,
                "algorithm": "native",
                "bytes": r.nbytes,
                "count": r.count,
                "dtype": r.dtype,
                "world_size": self.world_size,
                "nodes": self.nodes,
                "ranks_per_node": self.ranks_per_node,
                "gpu": self.gpu,
                "time_us": (r.out_of_place_us + r.in_place_us) / 2,
                "out_of_place_us": r.out_of_place_us,
                "in_place_us": r.in_place_us,
            }
            for r in self.rows
            if r.nbytes > 0
        ]


def looks_like_nccl_tests(text: str) -> bool:
    """Content sniffing: nccl-tests output has its column header or its device block."""
    head = text[:20000]
    return "out-of-place" in head or "Using devices" in head or "nThread" in head


def parse(path: Path) -> list[NcclRun]:
    """Every complete all_reduce_perf table of a log, with the layout from its device block."""
    return parse_text(path.read_text(errors="replace"), str(path))


def parse_text(text: str, name: str) -> list[NcclRun]:
    lines = text.splitlines()
    runs: list[NcclRun] = []
    hosts: dict[int, str] = {}
    gpu = ""
    columns: list[str] | None = None
    run: NcclRun | None = None
    program = ""
    for i, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or _NCCL_LOG.search(line):
            continue
        collective = _COLLECTIVE.search(line)
        if collective:
            program = collective.group(1).removesuffix("_mpi")
            if program not in PROGRAMS:
                raise NcclTestsError(
                    f"{name}: line {i}: this is {collective.group(1)} output; "
                    f"calibrate reads {' and '.join(PROGRAMS)} logs"
                )
        rank = _RANK.match(line)
        if rank:
            if run is not None and run.rows:  # a new run's device block after a finished table
                raise _truncated(name, i, run)
            hosts.setdefault(int(rank.group("rank")), rank.group("host"))
            gpu = gpu or rank.group("gpu")
            if run is not None:
                run.gpu = run.gpu or gpu
            continue
        if _is_column_header(line):
            if run is None or not run.rows:
                columns = _column_names(line)
                run = NcclRun(name, i, hosts, gpu)  # shares `hosts`: a repeated block still counts
            continue
        if line.lstrip("# ").startswith(_END):
            if run is None or not run.rows:
                raise NcclTestsError(f"{name}: line {i}: a bandwidth summary without a table before it")
            run.collective = _collective(run, program, name, i)
            runs.append(run)
            run, columns, hosts, gpu, program = None, None, {}, "", ""
            continue
        if columns is not None and run is not None and line[0].isdigit():
            run.rows.append(_row(line, columns, name, i))
    if run is not None:
        raise _truncated(name, len(lines), run)
    if not runs:
        raise NcclTestsError(
            f"{name}: line 1: no all_reduce_perf table found, nor an alltoall_perf one (expected nccl-tests "
            "output with a "
            "'size count type ... time algbw busbw' header and a '# Avg bus bandwidth' line)"
        )
    for r in runs:
        _check_layout(r)
    return runs


def _is_column_header(line: str) -> bool:
    words = line.lstrip("#").split()
    return len(words) > 4 and words[:2] == ["size", "count"] and "time" in words


def _column_names(line: str) -> list[str]:
    """Header words; 'time', 'algbw', 'busbw' and the error column appear once per placement."""
    return ["error" if w in ("#wrong", "wrong", "error") else w for w in line.lstrip("#").split()]


def _row(line: str, columns: list[str], name: str, i: int) -> NcclRow:
    words = line.split()
    if len(words) != len(columns):
        raise NcclTestsError(
            f"{name}: line {i}: expected {len(columns)} columns ({' '.join(columns)}), found {len(words)}: "
            "the log is cut or garbled here"
        )
    times = [j for j, c in enumerate(columns) if c == "time"]
    try:
        out_of_place = float(words[times[0]])
        in_place = float(words[times[1]]) if len(times) > 1 else out_of_place
        redop = words[columns.index("redop")] if "redop" in columns else "sum"
        return NcclRow(int(words[0]), int(words[1]), words[2], out_of_place, in_place, redop)
    except ValueError:
        raise NcclTestsError(f"{name}: line {i}: cannot read a size and times from {line!r}") from None


def _collective(run: NcclRun, program: str, name: str, i: int) -> str:
    """What a finished table measured: its program's collective; without the program line, an
    all-reduce, unless its rows reduce nothing (all_gather_perf and alltoall_perf look alike)."""
    if program:
        return PROGRAMS[program]
    if all(r.redop == "none" for r in run.rows):
        raise NcclTestsError(
            f"{name}: line {i}: the table that starts at line {run.line} reduces nothing (redop none) "
            "and the log lacks nccl-tests' '# Collective test starting: ...' line; keep that line "
            "so that an alltoall_perf table can be told from an all_gather_perf one"
        )
    return "all_reduce"


def _truncated(name: str, i: int, run: NcclRun) -> NcclTestsError:
    return NcclTestsError(
        f"{name}: line {i}: the table that starts at line {run.line} ends without nccl-tests' "
        "'# Avg bus bandwidth' line; the run was cut short: rerun it or remove the partial table"
    )


def _check_layout(run: NcclRun) -> None:
    if not run.hosts:
        raise NcclTestsError(
            f"{run.path}: line {run.line}: no 'Rank ... on HOST device ...' lines before the table; "
            "keep nccl-tests' '# Using devices' block in the log"
        )
    per_host = Counter(run.hosts.values())
    if len(set(per_host.values())) != 1:
        raise NcclTestsError(
            f"{run.path}: line {run.line}: ranks per host differ ({dict(per_host)}); "
            "calibrate needs the same number of GPUs on every node"
        )
