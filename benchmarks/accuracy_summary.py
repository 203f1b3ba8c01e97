"""The planner's accuracy on published runs, summarised by source, GPU and parallelism.

Reads the dense rows (docs/data/published-runs.json) and the planner's results on them
(docs/data/published-runs-results.json, written by benchmarks/published_runs.py), then the
mixture-of-experts, FP8 and Blackwell rows (docs/data/published-runs-moe.json,
docs/data/published-moe-runs-results.json, written by benchmarks/published_moe_runs.py), and prints
the markdown tables at the top of docs/results/planner-accuracy.md:

    python benchmarks/accuracy_summary.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "docs" / "data" / "published-runs.json"
RESULTS = ROOT / "docs" / "data" / "published-runs-results.json"
MOE_ROWS = ROOT / "docs" / "data" / "published-runs-moe.json"
MOE_RESULTS = ROOT / "docs" / "data" / "published-moe-runs-results.json"
MOE_HEADING = (
    "Mixture-of-experts, FP8 and Blackwell runs ([their page](planner-accuracy-moe.md)); the error is "
    "of tokens per second per GPU, + where the planner predicts more:"
)
SPANS = {
    "node": "MoE, EP inside a node",
    "rack": "MoE, EP inside an NVL72 rack",
    "nodes": "MoE, EP across nodes",
}


def parallelism(training: dict[str, Any]) -> str:
    """The layout family a row belongs to."""
    if training.get("zero", 0) == 3:
        return "FSDP / ZeRO-3" + (" with TP" if training.get("tp", 1) > 1 else "")
    if training.get("pp", 1) > 1:
        return "TP x PP" + (" x CP" if training.get("cp", 1) > 1 else "") + " (ZeRO 0-2)"
    if training.get("tp", 1) > 1 or training.get("cp", 1) > 1:
        return "TP or CP, no PP (ZeRO 0-2)"
    return "data parallel only (ZeRO 0-2)"


def moe_parallelism(row: dict[str, Any]) -> str:
    """An MoE row by where its expert all-to-all runs; a dense FP8 row by its precision."""
    if row.get("ep_span"):
        return SPANS[row["ep_span"]]
    return "dense, " + ("FP8" if row["training"].get("dtype") == "fp8" else "BF16")


def gpu(row: dict[str, Any]) -> str:
    """The GPU's family: A100, H100, H800, B200 or GB200."""
    name = row["system"]["gpu"]
    return next((g for g in ("GB200", "B200", "H800", "H100") if g in name), "A100")


def groups(
    rows: dict[str, Any], results: list[dict[str, Any]], moe: bool = False
) -> dict[str, dict[str, list[float]]]:
    """Signed errors per group, under the headings "source", "GPU" and "parallelism"."""
    by_id = {r["id"]: r for r in rows["rows"]}
    out: dict[str, dict[str, list[float]]] = {"source": {}, "GPU": {}, "parallelism": {}}
    for result in results:
        if result.get("status") != "ok":
            continue
        row = by_id[result["id"]]
        keys = {
            "source": rows["sources"][row["source"]]["organization"],
            "GPU": gpu(row),
            "parallelism": moe_parallelism(row) if moe else parallelism(row["training"]),
        }
        for heading, key in keys.items():
            out[heading].setdefault(key, []).append(result["error"])
    out["all"] = {"all rows": [r["error"] for r in results if r.get("status") == "ok"]}
    return out


def markdown(rows: dict[str, Any], results: list[dict[str, Any]], moe: bool = False) -> str:
    lines = [
        "| by | group | rows | median \\|error\\| | max \\|error\\| | mean error |",
        "|---|---|---|---|---|---|",
    ]
    for heading, found in groups(rows, results, moe).items():
        for key, errors in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            mags = [abs(e) for e in errors]
            lines.append(
                f"| {heading} | {key} | {len(errors)} | {statistics.median(mags):.1%} | {max(mags):.1%} "
                f"| {statistics.mean(errors):+.1%} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--moe-rows", type=Path, default=MOE_ROWS)
    parser.add_argument("--moe-results", type=Path, default=MOE_RESULTS)
    args = parser.parse_args()
    results = json.loads(args.results.read_text())["results"]
    print(markdown(json.loads(args.rows.read_text()), results), end="")
    moe_results = [r for r in json.loads(args.moe_results.read_text())["results"] if "pair" not in r["id"]]
    print(f"\n{MOE_HEADING}\n")
    print(markdown(json.loads(args.moe_rows.read_text()), moe_results, moe=True), end="")


if __name__ == "__main__":
    main()
