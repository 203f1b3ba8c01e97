"""How much host time per MoE layer each published MoE run would need to be host-bound at its figure
(docs/results/planner-accuracy-moe.md, "Host-bound MoE layers").

In dropless training the host waits for the token counts once per MoE layer forward, so it cannot run
ahead of the GPU by more than a layer: where the host's time to issue a layer's kernels exceeds the
GPU's time for them, the layer takes the host's time. This script asks, for every MoE row of
docs/data/published-runs-moe.json the planner accepts, what that host time would have to be for the
row's published step: the published step less what the planner predicts outside the micro-batches
(pipeline fill, exposed gradient reduction, optimizer), over the micro-batches and the slowest stage's
MoE layers. Beside it: the planner's own time per MoE layer and micro-batch on the GPU (compute and the
exposed TP, CP and EP exchanges of the stage, over its MoE layers), and the CUDA graph scopes the
row's recipe sets (`cuda_graph_scope`; "?" where the source does not say). A host-bound row needs more
host time than GPU time; one host time per layer explains the rows only if the rows of one software
stack and machine ask for about the same.

Pure arithmetic on any machine (each row's contract command, in this process):

    PYTHONPATH=. python benchmarks/moe_host_time.py --markdown docs/data/moe-host-time.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
from math import ceil
from pathlib import Path
from typing import Any

from benchmarks.published_moe_runs import command, load, measured_tokens_per_s_per_gpu
from benchmarks.published_runs import run_cli
from ringtree.sim.training.transformer import Transformer


def host_time(row: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any] | None:
    """The row's per-MoE-layer figures, in seconds per micro-batch; None for a dense model."""
    model = Transformer(**plan["details"]["model"])
    if not model.experts:
        return None
    m, b = int(plan["micro_batches"]), plan["breakdown"]
    per_micro_batch = (b["compute_s"] + b["tp_comm_s"] + b["cp_comm_s"] + b["ep_comm_s"]) / m
    outside = float(plan["step_s"]) - m * per_micro_batch
    layers = ceil(model.moe_layer_count / int(plan["pp"]))  # the slowest stage's MoE layers
    tokens = int(row["training"]["global_batch"]) * model.seq / int(row["system"]["gpus"])
    published_step = tokens / measured_tokens_per_s_per_gpu(row)
    return {
        "id": row["id"],
        "micro_batches": m,
        "moe_layers": layers,
        "gpu_s": per_micro_batch / layers,
        "needed_s": (published_step - outside) / (m * layers),
        "error": float(plan["tokens_per_s_per_gpu"]) / measured_tokens_per_s_per_gpu(row) - 1,
        "cuda_graph_scope": row.get("cuda_graph_scope"),
    }


def run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each MoE row the planner accepts, as `host_time` sees it."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        for row in rows:
            path.unlink(missing_ok=True)
            code, _ = run_cli(command(row, path), in_process=True)
            if code == 0 and path.exists():
                found = host_time(row, json.loads(path.read_text()))
                if found is not None:
                    out.append(found)
    return out


def _scope(scope: list[str] | None) -> str:
    return "?" if scope is None else ", ".join(scope) or "none"


def markdown(found: list[dict[str, Any]]) -> str:
    """One line per row: its CUDA graphs, the planner's GPU time and the host time it would need."""
    out = [
        "| run | CUDA graphs (recipe) | micro-batches | MoE layers per stage | GPU per MoE layer (planner) "
        "| host per MoE layer to be host-bound at the published step | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in found:
        out.append(
            f"| {f['id']} | {_scope(f['cuda_graph_scope'])} | {f['micro_batches']} | {f['moe_layers']} "
            f"| {f['gpu_s'] * 1e3:.1f} ms | {f['needed_s'] * 1e3:.1f} ms | {f['error']:+.1%} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="Run only rows whose id contains this text.")
    parser.add_argument("--markdown", type=Path, help="Write the table here.")
    args = parser.parse_args()
    rows = [r for r in load()["rows"] if args.only in r["id"] and r["training"]["ep"] > 1]
    table = markdown(run(rows))
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
