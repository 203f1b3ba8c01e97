"""Uncalibrated cluster presets against published nccl-tests all_reduce_perf tables.

The record: docs/results/collective-model-accuracy.md.

Each table (tests/data/nccl-tests, sources in its README) is compared with what
`ringtree sim --cluster NAME --nodes N --algorithm native --bytes SIZE` predicts for every logged
size: NCCL's own cost model on the preset's links, no calibration. The measured time of a size is
the faster of its out-of-place and in-place times (a table's first row often carries a warm-up).

Run: PYTHONPATH=. python benchmarks/nccl_published.py [--json OUT]   (model arithmetic, under a second)
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtree.sim.network.allreduce import allreduce_time
from ringtree.sim.network.clusters import preset_cluster
from ringtree.sim.network.nccl_tests import parse

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl-tests"


@dataclass(frozen=True)
class Table:
    """One published table and the preset (with any link the command line names) that models it."""

    log: str
    cluster: str
    system: str
    inter: str | None = None


TABLES = (
    Table("h100-2x8-p5-efa.log", "p5.48xlarge", "AWS p5.48xlarge, EFA (SageMaker HyperPod)"),
    Table("h100-4x8-p5-efa.log", "p5.48xlarge", "AWS p5.48xlarge, EFA (SageMaker HyperPod)"),
    Table("h100-8x8-p5-efa.log", "p5.48xlarge", "AWS p5.48xlarge, EFA (SageMaker HyperPod)"),
    Table("h100-16x8-p5-efa.log", "p5.48xlarge", "AWS p5.48xlarge, EFA (SageMaker HyperPod)"),
    Table("h100-2x8-ndr.log", "dgx-h100", "HGX H100 (Dell XE9680), 8 x CX-7 NDR"),
    Table("h100-4x8-ndr.log", "dgx-h100", "HGX H100 (VMs), 8 x CX-7 NDR"),
    Table("h100-8x8-ndr.log", "dgx-h100", "HGX H100, 8 NICs, 8 nodes"),
    Table(
        "h100-2x8-a3mega.log", "dgx-h100", "GCP a3-mega, 8 x 200G GPUDirect-TCPXO", "bw=200Gbit/s,lat=10us"
    ),
    Table("a100-2x8-oci.log", "dgx-a100", "OCI BM.GPU.B4.8 on OKE, 16 x 100G RoCE"),
)


def compare(table: Table) -> list[dict[str, Any]]:
    """One row per logged size: measured and predicted microseconds, NCCL's pick, the error."""
    (run,) = parse(DATA / table.log)
    cluster = preset_cluster(table.cluster, run.nodes, inter=table.inter)
    out = []
    for r in run.rows:
        measured = min(r.out_of_place_us, r.in_place_us)
        est = allreduce_time("native", cluster, r.nbytes)
        predicted = est.seconds * 1e6
        out.append(
            {"log": table.log, "cluster": table.cluster, "nodes": run.nodes, "bytes": r.nbytes,
             "measured_us": measured, "predicted_us": predicted, "nccl_choice": est.nccl,
             "error": predicted / measured - 1.0}
        )  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median and max |error| of some rows."""
    errors = [abs(r["error"]) for r in rows]
    return {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors), "rows": len(rows)}


def results() -> dict[str, Any]:
    """Every table's rows and summary, and the summary over all rows and over the tables' medians."""
    tables = {t.log: compare(t) for t in TABLES}
    every = [r for rows in tables.values() for r in rows]
    medians = [summary(rows)["median_abs_error"] for rows in tables.values()]
    return {
        "tables": {name: {"summary": summary(rows), "rows": rows} for name, rows in tables.items()},
        "all_rows": summary(every),
        "median_of_table_medians": statistics.median(medians),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row and summary here")
    args = parser.parse_args()
    res = results()
    print("| table | system | preset | nodes | sizes | median abs error | max |")
    print("|---|---|---|---|---|---|---|")
    for t in TABLES:
        s = res["tables"][t.log]["summary"]
        nodes = res["tables"][t.log]["rows"][0]["nodes"]
        preset = t.cluster + (f" --inter '{t.inter}'" if t.inter else "")
        print(
            f"| {t.log} | {t.system} | {preset} | {nodes} | {s['rows']} | "
            f"{s['median_abs_error']:.1%} | {s['max_abs_error']:.0%} |"
        )
    a = res["all_rows"]
    print(
        f"\nall {a['rows']} rows: median |error| {a['median_abs_error']:.1%}, max {a['max_abs_error']:.0%}; "
        f"median of the tables' medians {res['median_of_table_medians']:.1%}"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
