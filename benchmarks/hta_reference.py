"""Holistic Trace Analysis's own figures on the sample traces in shared/traces/, for the tests.

    python3 -m venv .venv-hta && .venv-hta/bin/pip install traceinsight==0.6.1
    .venv-hta/bin/python benchmarks/hta_reference.py --json tests/data/hta_reference.json

HTA (PyPI `traceinsight`, import `hta`) is never a dependency of ringtree: it runs here once, in
its own virtual environment, and the tests compare ringtree's figures against the JSON this
writes (`get_temporal_breakdown`, `get_comm_comp_overlap`, `get_idle_time_breakdown`, per rank,
HTA's defaults: every ProfilerStep but the last).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "shared" / "traces"

# One TraceAnalysis per set: the files of one run, by rank.
SETS = {
    "a2a-a100": {0: "a2a-a100/sampled_rank-0.json.gz", 1: "a2a-a100/sampled_rank-1.json.gz"},
    "ddp-a100": {0: "ddp-a100/nccl_data.json.gz"},
    "fsdp-a100": {0: "fsdp-a100/rank0.json.gz"},
    "a2a-v100": {1: "a2a-v100/test.json.gz"},
}


def figures(files: dict[int, str]) -> dict[str, Any]:
    from hta.trace_analysis import TraceAnalysis

    paths = {rank: str(TRACES / name) for rank, name in files.items()}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ta = TraceAnalysis(trace_files=paths, trace_dir=str(TRACES))
        temporal = ta.get_temporal_breakdown(visualize=False)
        overlap = ta.get_comm_comp_overlap(visualize=False)
        idle, _ = ta.get_idle_time_breakdown(ranks=sorted(paths), visualize=False)
    ranks = []
    for row in temporal.to_dict("records"):
        rank = int(row["rank"])
        ranks.append(
            {
                "rank": rank,
                "kernel_us": float(row["kernel_time(us)"]),
                "compute_us": float(row["compute_time(us)"]),
                "non_compute_us": float(row["non_compute_time(us)"]),
                "idle_us": float(row["idle_time(us)"]),
                "compute_pct": float(row["compute_time_pctg"]),
                "non_compute_pct": float(row["non_compute_time_pctg"]),
                "idle_pct": float(row["idle_time_pctg"]),
                "comm_overlap_pct": float(overlap.set_index("rank").loc[rank, "comp_comm_overlap_pctg"]),
                "idle_by_stream": [
                    {
                        "stream": int(r["stream"]),
                        "category": r["idle_category"],
                        "idle_us": float(r["idle_time"]),
                    }
                    for r in idle[idle["rank"] == rank].to_dict("records")
                ],
            }
        )
    return {"files": files, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    import hta

    out = {
        "hta": getattr(hta, "__version__", "traceinsight 0.6.1"),
        "command": "benchmarks/hta_reference.py",
        "sets": {name: figures(files) for name, files in SETS.items()},
    }
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
