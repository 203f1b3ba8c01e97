"""`ringtree trace`'s reading against Holistic Trace Analysis's, side by side on the same files:
wall time and peak memory (RSS of the whole process tree: both parse ranks in parallel
processes), median of 3 runs, each in a fresh interpreter.

    python3 -m venv .venv-hta && .venv-hta/bin/pip install traceinsight==0.6.1
    .venv/bin/python benchmarks/trace_speed.py --json trace_speed.json

ringtree: `load.read_all` + `report.analyse` (breakdown, overlap, collectives matched across
ranks, stragglers). HTA: `TraceAnalysis(trace_files=...)` + `get_temporal_breakdown` +
`get_comm_comp_overlap`. `work_s` is that work inside the process (imports excluded), `wall_s`
the whole process, `peak_mb` the most memory the process and its children held at once (sampled
every 10 ms). Cases: HTA's sample traces in shared/traces/, and fsdp-a100's rank 0 copied as 8
ranks (the same file renumbered) for a many-rank run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "shared" / "traces"
RINGTREE_PY = ROOT / ".venv" / "bin" / "python"
HTA_PY = ROOT / ".venv-hta" / "bin" / "python"

RINGTREE = """
import sys, time
t = time.perf_counter()
from pathlib import Path
from ringtree.trace import load, report
t0 = time.perf_counter()
r = report.analyse(load.read_all([Path(p) for p in sys.argv[1:]]))
r.as_dict()
print(time.perf_counter() - t0)
"""
HTA = """
import sys, time, logging, io, contextlib, gzip, re
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
t0 = time.perf_counter()
files = {}
for p in sys.argv[1:]:
    head = gzip.open(p).read(4096).decode(errors="ignore") if p.endswith(".gz") else open(p).read(4096)
    files[int(re.search(r'"rank":\\s*(\\d+)', head).group(1))] = p
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    ta = TraceAnalysis(trace_files=files, trace_dir="/")
    ta.get_temporal_breakdown(visualize=False)
    ta.get_comm_comp_overlap(visualize=False)
print(time.perf_counter() - t0)
"""


def tree_rss_kb(pid: int) -> int:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(python: Path, code: str, files: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(python), "-c", code, *files], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kb(proc.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - start
    out = proc.stdout.read().decode() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{python} failed on {files} (exit {proc.returncode})")
    return {"work_s": float(out.strip().splitlines()[-1]), "wall_s": wall, "peak_mb": peak / 1024}


def cases(tmp: Path) -> dict[str, list[str]]:
    out = {
        name: sorted(str(p) for p in (TRACES / name).iterdir())
        for name in ("a2a-a100", "ddp-a100", "fsdp-a100", "a2a-v100")
    }
    doc = json.loads(gzip.decompress((TRACES / "fsdp-a100" / "rank0.json.gz").read_bytes()))
    many = []
    for rank in range(8):
        doc["distributedInfo"]["rank"] = rank
        doc["distributedInfo"]["world_size"] = 8
        path = tmp / f"rank{rank}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
        many.append(str(path))
    out["fsdp-a100 x8"] = many
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if not HTA_PY.exists():
        sys.exit(f"{HTA_PY} is missing: create it as this file's docstring says")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, files in cases(Path(tmp)).items():
            runs: dict[str, list[dict[str, float]]] = {"ringtree": [], "hta": []}
            for _ in range(args.runs):  # alternate, so that load drift touches both alike
                runs["ringtree"].append(measure(RINGTREE_PY, RINGTREE, files))
                runs["hta"].append(measure(HTA_PY, HTA, files))
            row: dict[str, Any] = {"case": name, "files": len(files)}
            for tool, ms in runs.items():
                for key in ("work_s", "wall_s", "peak_mb"):
                    row[f"{tool}_{key}"] = statistics.median(m[key] for m in ms)
            row["speedup_work"] = statistics.median(
                h["work_s"] / r["work_s"] for r, h in zip(runs["ringtree"], runs["hta"], strict=True)
            )
            row["speedup_wall"] = statistics.median(
                h["wall_s"] / r["wall_s"] for r, h in zip(runs["ringtree"], runs["hta"], strict=True)
            )
            row["memory_ratio"] = row["ringtree_peak_mb"] / row["hta_peak_mb"]
            rows.append(row)
            r = row
            line = f"{name:14s} {len(files)} files  ringtree {r['ringtree_work_s']:.2f} s "
            line += f"{r['ringtree_peak_mb']:.0f} MB  HTA {r['hta_work_s']:.2f} s {r['hta_peak_mb']:.0f} MB  "
            line += f"speedup {r['speedup_work']:.2f}x (whole process {r['speedup_wall']:.2f}x)  "
            print(line + f"memory {r['memory_ratio']:.2f}x", flush=True)
    env = {"python": platform.python_version(), "host_cores": os.cpu_count(), "machine": platform.machine()}
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "runs": args.runs, "rows": rows}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
