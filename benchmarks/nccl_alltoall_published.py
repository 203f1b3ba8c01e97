"""Uncalibrated cluster presets against published nccl-tests alltoall_perf tables
(docs/results/collective-model-accuracy.md).

Each table (tests/data/nccl-tests, sources in its README) is compared with what `ringtree sim
--cluster NAME --nodes N --collective all-to-all --algorithm native --bytes SIZE` predicts for every
logged size of at least 1 MiB: NCCL's all-to-all model (grouped point-to-point) on the preset's
links, no calibration. The measured time of a size is the faster of its out-of-place and in-place
times. Hosts that share an NVLink domain (GB200 / GB300 NVL72 racks) are priced as one node of that
many GPUs (`Table.domain`).

Run: PYTHONPATH=. python benchmarks/nccl_alltoall_published.py [--json OUT]   (model arithmetic)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.nccl_published import summary
from ringtree.sim.network.alltoall import alltoall_time
from ringtree.sim.network.clusters import preset_cluster
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.network.nccl_tests import parse

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl-tests"
MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Table:
    """One published table and the preset that models it.

    `domain`: GPUs per NVLink domain when the log's hosts share NVLink (a GB200 / GB300 NVL72 rack,
    16 hosts of 4 in these runs): priced as nodes of that many GPUs with one NIC per GPU (each
    NVL72 tray has a 400 Gb/s NIC per GPU, as the DGX B200 preset has); 0: the log's own hosts.
    """

    log: str
    cluster: str
    system: str
    domain: int = 0


_GB200 = "OCI GB200 NVL72 (B200 GPUs, NVLink 5)"
_GB300 = "OCI GB300 NVL72 (B300 GPUs, NVLink 5)"
TABLES = (
    Table("h100-1x4-alltoall.log", "dgx-h100", "4 x H100 SXM, one node (NVIDIA/nccl#2169)"),
    Table("gb200-1x4-nvl72-alltoall.log", "dgx-b200", f"{_GB200}, 1 host of 4", 4),
    Table("gb200-2x4-nvl72-alltoall.log", "dgx-b200", f"{_GB200}, 2 hosts of 4, one rack", 8),
    Table("gb200-16x4-nvl72-alltoall.log", "dgx-b200", f"{_GB200}, 16 hosts of 4, one rack", 64),
    Table("gb200-32x4-nvl72-alltoall.log", "dgx-b200", f"{_GB200}, 32 hosts of 4, two racks", 64),
    Table("gb200-48x4-nvl72-alltoall.log", "dgx-b200", f"{_GB200}, 48 hosts of 4, three racks", 64),
    Table("gb300-1x4-nvl72-alltoall.log", "dgx-b200", f"{_GB300}, 1 host of 4", 4),
    Table("gb300-2x4-nvl72-alltoall.log", "dgx-b200", f"{_GB300}, 2 hosts of 4, one rack", 8),
    Table("gb300-16x4-nvl72-alltoall.log", "dgx-b200", f"{_GB300}, 16 hosts of 4, one rack", 64),
    Table("gb300-32x4-nvl72-alltoall.log", "dgx-b200", f"{_GB300}, 32 hosts of 4, two racks", 64),
    Table("h100-2x8-p5-efa-alltoall.log", "p5.48xlarge", "AWS p5.48xlarge, EFA (HyperPod), 2 nodes"),
    Table("h100-4x8-p5-efa-alltoall.log", "p5.48xlarge", "same, 4 nodes"),
    Table("h100-8x8-p5-efa-alltoall.log", "p5.48xlarge", "same, 8 nodes"),
    Table("h100-16x8-p5-efa-alltoall.log", "p5.48xlarge", "same, 16 nodes"),
    Table("h100-32x8-p5-efa-alltoall.log", "p5.48xlarge", "same, 32 nodes"),
)


def cluster_of(table: Table, world_size: int, nodes: int) -> Cluster:
    """The preset reshaped to the table's nodes (or NVLink domains) and GPUs per node."""
    if not table.domain:
        return preset_cluster(table.cluster, nodes, gpus_per_node=world_size // nodes)
    domains = max(1, world_size // table.domain)
    per_domain = world_size // domains
    cluster = preset_cluster(table.cluster, domains, gpus_per_node=per_domain)
    return dataclasses.replace(cluster, nics_per_node=per_domain)


def compare(table: Table) -> list[dict[str, Any]]:
    """One row per logged size of at least 1 MiB: measured and predicted microseconds, the error."""
    (run,) = parse(DATA / table.log)
    cluster = cluster_of(table, run.world_size, run.nodes)
    out = []
    for r in run.rows:
        if r.nbytes < MIN_BYTES:
            continue
        measured = min(r.out_of_place_us, r.in_place_us)
        predicted = alltoall_time("native", cluster, r.nbytes).seconds * 1e6
        out.append(
            {"log": table.log, "cluster": table.cluster, "nodes": cluster.nodes,
             "gpus_per_node": cluster.gpus_per_node, "bytes": r.nbytes, "measured_us": measured,
             "predicted_us": predicted, "error": predicted / measured - 1.0}
        )  # fmt: skip
    return out


def results() -> dict[str, Any]:
    """Every table's rows and summary."""
    tables = {t.log: compare(t) for t in TABLES}
    return {
        "tables": {log: {"system": t.system, "summary": summary(tables[log]), "rows": tables[log]}
                   for t in TABLES for log in [t.log]},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row and summary here")
    args = parser.parse_args()
    out = results()
    print(f"{'table':34} {'preset':12} {'shape':>7} {'sizes':>5} {'median |err|':>12} {'max |err|':>9}")
    for log, t in out["tables"].items():
        s, first = t["summary"], t["rows"][0]
        shape = f"{first['nodes']}x{first['gpus_per_node']}"
        print(f"{log:34} {first['cluster']:12} {shape:>7} {s['rows']:5d} {s['median_abs_error']:12.1%} "
              f"{s['max_abs_error']:9.1%}")  # fmt: skip
        for r in t["rows"]:
            print(f"    {r['bytes']:>12d} B  measured {r['measured_us']:10.1f} us  predicted "
                  f"{r['predicted_us']:10.1f} us  {r['error']:+.1%}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
