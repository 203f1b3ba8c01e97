"""`ringtree plan` against published mixture-of-experts, FP8 and Blackwell training runs
(docs/results/planner-accuracy-moe.md).

Each row of docs/data/published-runs-moe.json (a run someone else measured: model preset, layout, GPUs,
the figure they published and where) becomes the planner's contract command

    ringtree plan --model PRESET --global-batch B --micro-batch b --seq S --tp T --pp P
        [--virtual-stages V] [--cp C] [--ep E] [--etp X] --gpus G --cluster NAME --dtype bf16|fp8
        [--fp8-recipe R] [--recompute MODE] [EXTRA] --json OUT

(optional flags only where they differ from 1 / are needed; EXTRA: the options the planner already has
that the row's framework implies, each row's `extra_args`, with its reason under `assumed`), which is
run; `tokens_per_s_per_gpu` (or, where a planner has not added it yet, global batch x sequence /
`step_s` / GPUs) is read from its JSON. A row whose options the planner refuses (exit code 2) is
reported as "not supported" with the planner's sentence.

The error is a throughput error, signed, + where the planner predicts more tokens per second per GPU
than was published: predicted / published - 1. A published step time converts exactly (global batch x
sequence / step / GPUs). For every FP8 row with a `bf16_pair` (the same source, layout and software
in BF16), the predicted FP8 speed-up (FP8 tokens/s over BF16 tokens/s) is compared with the published
one: predicted / published - 1.

Pure arithmetic on any machine:

    PYTHONPATH=. python benchmarks/published_moe_runs.py --json docs/data/published-moe-runs-results.json \
        --markdown docs/data/published-moe-runs-results.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.published_runs import environment, run_cli

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "published-runs-moe.json"


def load(path: Path = DATA) -> dict[str, Any]:
    """The dataset: {"sources": {id: ...}, "rows": [...]}."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def command(row: dict[str, Any], out: Path) -> list[str]:
    """The contract `ringtree plan` arguments for one row (degrees of 1 left out), then its extra options."""
    m, t, s = row["model"], row["training"], row["system"]
    args = ["plan", "--model", m["preset"], "--global-batch", str(t["global_batch"])]
    args += ["--micro-batch", str(t["micro_batch"]), "--seq", str(m["seq"])]
    args += ["--tp", str(t["tp"]), "--pp", str(t["pp"])]
    for key, flag in (
        ("virtual_stages", "--virtual-stages"),
        ("cp", "--cp"),
        ("ep", "--ep"),
        ("etp", "--etp"),
    ):
        args += [flag, str(t[key])] if t[key] > 1 else []
    args += ["--gpus", str(s["gpus"]), "--cluster", s["cluster"], "--dtype", t["dtype"]]
    args += ["--fp8-recipe", t["fp8_recipe"]] if t["dtype"] == "fp8" else []
    args += ["--recompute", t["recompute"], *row.get("extra_args", [])]
    return [*args, "--json", str(out)]


def measured_tokens_per_s_per_gpu(row: dict[str, Any]) -> float:
    """The published figure as tokens per second per GPU (a step time converts exactly)."""
    meas, gpus = row["measured"], int(row["system"]["gpus"])
    tokens = int(row["training"]["global_batch"]) * int(row["model"]["seq"])
    if meas["metric"] == "tokens_per_s_per_gpu":
        return float(meas["value"])
    if meas["metric"] == "step_s":
        return tokens / (float(meas["value"]) * gpus)
    raise ValueError(
        f"row {row['id']}: unknown metric {meas['metric']!r}; use tokens_per_s_per_gpu or step_s"
    )


def predicted_tokens_per_s_per_gpu(row: dict[str, Any], plan: dict[str, Any]) -> float:
    """The planner's tokens/s per GPU: its own key, else global batch x sequence / step / GPUs."""
    if "tokens_per_s_per_gpu" in plan:
        return float(plan["tokens_per_s_per_gpu"])
    tokens = int(row["training"]["global_batch"]) * int(row["model"]["seq"])
    return tokens / (float(plan["step_s"]) * int(row["system"]["gpus"]))


def outcome(row: dict[str, Any], returncode: int, output: str, plan: dict[str, Any] | None) -> dict[str, Any]:
    """A finished command's result: compared, or why the planner could not speak."""
    lines = [ln.strip(" │╭╰╮╯─") for ln in output.splitlines()]
    said = (
        " ".join(ln for ln in lines if ln and not ln.startswith(("Usage:", "Try ", "Error")))
        or output.strip()
    )
    if returncode == 2:
        return {"status": "not supported", "reason": said[:300]}
    if returncode or plan is None:
        return {"status": "failed", "reason": f"exit code {returncode}: {said[:300]}"}
    if "step_s" not in plan and "tokens_per_s_per_gpu" not in plan:
        return {"status": "not supported", "reason": "the plan's JSON has no step_s or tokens_per_s_per_gpu"}
    predicted = predicted_tokens_per_s_per_gpu(row, plan)
    measured = measured_tokens_per_s_per_gpu(row)
    fits = plan.get("memory", {}).get("fits")
    ep_comm = plan.get("breakdown", {}).get("ep_comm_s")
    return {"status": "ok", "predicted": predicted, "measured": measured, "error": predicted / measured - 1,
            "fits": fits, "ep_comm_s": ep_comm}  # fmt: skip


def run_row(row: dict[str, Any], in_process: bool = False) -> dict[str, Any]:
    """Run the row's command and compare; never raises for what the planner refuses."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args = command(row, out)
        returncode, output = run_cli(args, in_process)
        plan = json.loads(out.read_text()) if out.exists() else None
    result = outcome(row, returncode, output, plan)
    return {"id": row["id"], "command": "ringtree " + shlex.join([*args[:-1], "plan.json"]), **result}


def speedups(data: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each published BF16/FP8 pair: the published and the predicted FP8 speed-up, and the error."""
    by_id = {r["id"]: r for r in results}
    pairs = []
    for row in data["rows"]:
        if "bf16_pair" not in row or row["id"] not in by_id or row["bf16_pair"] not in by_id:
            continue
        fp8, bf16 = by_id[row["id"]], by_id[row["bf16_pair"]]
        bf16_row = next(r for r in data["rows"] if r["id"] == row["bf16_pair"])
        pair: dict[str, Any] = {"fp8": row["id"], "bf16": row["bf16_pair"]}
        pair["published"] = measured_tokens_per_s_per_gpu(row) / measured_tokens_per_s_per_gpu(bf16_row)
        if fp8["status"] == "ok" and bf16["status"] == "ok":
            pair["predicted"] = fp8["predicted"] / bf16["predicted"]
            pair["error"] = pair["predicted"] / pair["published"] - 1
        pairs.append(pair)
    return pairs


def summary(data: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, mean and max |error| over the rows that ran (pair-only rows left out), and the counts."""
    pair_only = {r["id"] for r in data["rows"] if r.get("pair_only")}
    counted = [r for r in results if r["id"] not in pair_only]
    errors = [abs(r["error"]) for r in counted if r["status"] == "ok"]
    stats: dict[str, Any] = {"rows": len(counted), "compared": len(errors)}
    stats["not_supported"] = sum(r["status"] == "not supported" for r in counted)
    stats["failed"] = sum(r["status"] == "failed" for r in counted)
    if errors:
        stats["median_abs_error"] = statistics.median(errors)
        stats["mean_abs_error"] = statistics.fmean(errors)
        stats["max_abs_error"] = max(errors)
        stats["mean_error"] = statistics.fmean(r["error"] for r in counted if r["status"] == "ok")
    pair_errors = [abs(p["error"]) for p in speedups(data, results) if "error" in p]
    if pair_errors:
        stats["pairs"] = len(pair_errors)
        stats["max_abs_speedup_error"] = max(pair_errors)
        stats["median_abs_speedup_error"] = statistics.median(pair_errors)
    return stats


def _layout(row: dict[str, Any]) -> str:
    t = row["training"]
    parts = [f"TP{t['tp']} PP{t['pp']}"] + [f"VP{t['virtual_stages']}"] * (t["virtual_stages"] > 1)
    parts += (
        [f"CP{t['cp']}"] * (t["cp"] > 1)
        + [f"EP{t['ep']}"] * (t["ep"] > 1)
        + [f"ETP{t['etp']}"] * (t["etp"] > 1)
    )
    dtype = t["dtype"].upper() + (f" {t['fp8_recipe']}" if t["dtype"] == "fp8" else "")
    return " ".join([*parts, f"mbs{t['micro_batch']} gbs{t['global_batch']}", dtype, t["recompute"]])


def markdown(data: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The table of docs/results/planner-accuracy-moe.md: one line per row, the pairs' speed-ups, then
    the summary."""
    rows = {r["id"]: r for r in data["rows"]}
    out = ["| run | GPUs | layout | EP spans | published | tokens/s/GPU | predicted | error | fits |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        row = rows[r["id"]]
        gpus = f"{row['system']['gpus']} {row['system']['gpu'].split(' ')[0]}"
        span = row.get("ep_span") or "-"
        head = f"| {r['id']} | {gpus} | {_layout(row)} | {span} | {row['measured']['as_published'][:60]} |"
        if r["status"] != "ok":
            out.append(f"{head} {measured_tokens_per_s_per_gpu(row):,.0f} | | {r['status']} | |")
            continue
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        out.append(f"{head} {r['measured']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | {fits} |")
    out += ["", "| FP8 row | BF16 row | published speed-up | predicted | error |", "|---|---|---|---|---|"]
    for p in speedups(data, results):
        predicted = f"{p['predicted']:.3f} | {p['error']:+.1%}" if "error" in p else " | not compared"
        out.append(f"| {p['fp8']} | {p['bf16']} | {p['published']:.3f} | {predicted} |")
    s = summary(data, results)
    counts = f"{s['not_supported']} not supported, {s['failed']} failed"
    out.append(f"\n{s['compared']} of {s['rows']} rows compared ({counts})")
    if s["compared"]:
        out[-1] += f": median |error| {s['median_abs_error']:.1%}, mean {s['mean_abs_error']:.1%}, "
        out[-1] += f"max {s['max_abs_error']:.1%}, mean signed {s['mean_error']:+.1%}"
    if "pairs" in s:
        out[-1] += (
            f"; {s['pairs']} BF16/FP8 pairs: speed-up |error| median {s['median_abs_speedup_error']:.1%}"
        )
        out[-1] += f", max {s['max_abs_speedup_error']:.1%}"
    reasons = Counter(r["reason"] for r in results if r["status"] != "ok")
    out += [f"- {reason} ({n} rows)" for reason, n in reasons.most_common()]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="The dataset (default: %(default)s).")
    parser.add_argument("--only", default="", help="Run only rows whose id contains this text.")
    parser.add_argument("--jobs", type=int, default=1, help="Commands run at once (default 1).")
    parser.add_argument("--in-process", action="store_true", help="Run each command line in this process.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    parser.add_argument("--markdown", type=Path, help="Write the markdown table here.")
    args = parser.parse_args()
    data = load(args.data)
    rows = [r for r in data["rows"] if args.only in r["id"]]
    if args.in_process:
        results = [run_row(r, in_process=True) for r in rows]
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(run_row, rows))
    table = markdown(data, results)
    print(table, end="")
    if args.json:
        record = {"environment": environment(), "summary": summary(data, results), "results": results,
                  "speedups": speedups(data, results)}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
