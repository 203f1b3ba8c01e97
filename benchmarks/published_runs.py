"""`ringtree plan` against published training runs (docs/results/planner-accuracy.md).

Each row of docs/data/published-runs.json (a run someone else measured: model, layout, GPUs,
the figure they published and where) becomes the planner's contract command

    ringtree plan --model transformer --layers L --hidden H --heads A [--kv-heads K]
        [--ffn-hidden F] [--mlp gelu|swiglu] [--no-dropout] --seq S --vocab V --global-batch B --micro-batch b
        --tp T --pp P [--cp C] [--cp-comm all-gather] [--virtual-stages V] [--sequence-parallel]
        [--zero Z] [--shard-group S] [--overlap] [--no-flash-attention] [--attention-kernel flash2]
        [--elementwise eager] [--grad-dtype bf16] [--bucket-mb MiB]
        --nodes N --cluster NAME [--inter LINK --nics-per-node K]
        --dtype fp16|bf16 --recompute none|selective|full|op|dots [--recompute-layers K] --json OUT

(optional flags only where the row needs them), which is run; `step_s`, `mfu` and `memory.fits`
are read from its JSON. A row whose options the planner refuses (exit code 2: an option it does
not know yet, or a layout it rejects) is reported as "not supported" with the planner's sentence.

The error is a step-time error, signed, + when the planner predicts the longer step. Where the
source published a step time it is compared directly; tokens/s converts exactly (global batch x
sequence / tokens/s, or / (tokens/s x GPUs) when published per GPU); TFLOP/s and MFU convert
with the source's own FLOP count where it states it (the row's `measured.flops`); otherwise (the
Llama 3 paper's TFLOP/s, Korthikanti et al.'s MFU) the published figure is compared with the
planner's own `tflops_per_gpu` or `mfu`, and the error is measured / predicted - 1, the
step-time ratio that figure implies.

Pure arithmetic on any machine (a few seconds per row):

    PYTHONPATH=. python benchmarks/published_runs.py --json docs/data/published-runs-results.json \
        --markdown docs/data/published-runs-results.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ringtree.sim.network.clusters import get

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "published-runs.json"
MEGATRON_PEAK = 989e12  # the H100 BF16 peak Megatron-LM's README divides by (408.8 TFLOP/s = 41%)
OPTIONAL = {"kv_heads": "--kv-heads", "ffn_hidden": "--ffn-hidden", "mlp": "--mlp"}


def load(path: Path = DATA) -> dict[str, Any]:
    """The dataset: {"sources": {id: ...}, "rows": [...]}."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def command(row: dict[str, Any], out: Path) -> list[str]:
    """The contract `ringtree plan` arguments for one row; flags at their default are left out,
    so a row that needs no new option runs on a planner that has none."""
    m, t, s = row["model"], row["training"], row["system"]
    args = ["plan", "--model", "transformer", "--layers", str(m["layers"]), "--hidden", str(m["hidden"])]
    args += ["--heads", str(m["heads"])]
    defaults = {"kv_heads": m["heads"], "ffn_hidden": 4 * m["hidden"], "mlp": "gelu"}
    args += [f for k, flag in OPTIONAL.items() if m[k] != defaults[k] for f in (flag, str(m[k]))]
    args += [] if m["dropout"] else ["--no-dropout"]
    args += ["--seq", str(m["seq"]), "--vocab", str(m["vocab"])]
    args += ["--global-batch", str(t["global_batch"]), "--micro-batch", str(t["micro_batch"])]
    args += ["--tp", str(t["tp"]), "--pp", str(t["pp"])]
    args += ["--cp", str(t["cp"])] if t["cp"] > 1 else []
    args += ["--cp-comm", t["cp_comm"]] if t.get("cp_comm", "p2p") != "p2p" else []
    args += ["--virtual-stages", str(t["virtual_stages"])] if t["virtual_stages"] > 1 else []
    args += ["--sequence-parallel"] if t["sequence_parallel"] else []
    args += ["--zero", str(t["zero"])] if t["zero"] else []
    args += ["--shard-group", str(t["shard_group"])] if t.get("shard_group") else []
    args += ["--overlap"] if t.get("overlap") else []
    args += ["--no-flash-attention"] if not t.get("flash_attention", True) else []
    kernel = t.get("attention_kernel", "fused")
    args += ["--attention-kernel", kernel] if kernel != "fused" else []
    args += ["--elementwise", "eager"] if t.get("elementwise", "fused") == "eager" else []
    grads = t.get("grad_dtype", "fp32" if t["dtype"] == "bf16" else t["dtype"])
    args += ["--grad-dtype", grads] if grads != ("fp32" if t["dtype"] == "bf16" else t["dtype"]) else []
    args += ["--bucket-mb", f"{t['bucket_mb']:g}"] if t.get("bucket_mb", 25.0) != 25.0 else []
    args += ["--nodes", str(s["gpus"] // s["gpus_per_node"]), "--cluster", s["cluster"]]
    args += ["--inter", s["inter"], "--nics-per-node", str(s["nics_per_node"])] if "inter" in s else []
    return [*args, "--dtype", t["dtype"], "--recompute", t["recompute"], "--json", str(out)]


def model_flops(row: dict[str, Any], formula: str) -> float:
    """FLOPs of one iteration by the source's own count (see the dataset's `fields`)."""
    m, b = row["model"], row["training"]["global_batch"]
    s, layers, h, v = m["seq"], m["layers"], m["hidden"], m["vocab"]
    if formula == "megatron-2024":  # megatron/training/training.py num_floating_point_operations
        gated = 1.5 if m["mlp"] == "swiglu" else 1.0
        attention = 1 + m["kv_heads"] / m["heads"] + s / h
        return float(
            12 * b * s * layers * h * h * (attention + m["ffn_hidden"] / h * gated + v / (2 * layers * h))
        )
    if formula == "megatron-deepspeed-recompute":  # Narayanan et al. eq. 3, recompute factor 4
        return float(96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    raise ValueError(f"unknown FLOP count {formula!r}; use megatron-2024 or megatron-deepspeed-recompute")


def measured_step_s(row: dict[str, Any]) -> float | None:
    """The published figure as seconds per iteration, or None where it cannot be converted."""
    meas, gpus = row["measured"], int(row["system"]["gpus"])
    metric, value = meas["metric"], float(meas["value"])
    if metric == "step_s":
        return value
    tokens = int(row["training"]["global_batch"]) * int(row["model"]["seq"])
    if metric == "tokens_per_s":  # the whole job's
        return tokens / value
    if metric == "tokens_per_s_per_gpu":
        return tokens / (value * gpus)
    if "flops" not in meas:
        return None
    flops = model_flops(row, meas["flops"])
    if metric == "tflops_per_gpu":
        return flops / (value * 1e12 * gpus)
    if metric == "mfu":
        return flops / (value * MEGATRON_PEAK * gpus)
    raise ValueError(f"row {row['id']}: unknown metric {metric!r}")


def predicted_metric(row: dict[str, Any], plan: dict[str, Any]) -> float:
    """The planner's figure in the published metric's units (for rows not converted to a step)."""
    metric = row["measured"]["metric"]
    if metric == "mfu":
        return float(plan["mfu"])
    if "tflops_per_gpu" in plan:
        return float(plan["tflops_per_gpu"])
    gpu = get(row["system"]["cluster"]).gpu
    return float(plan["mfu"]) * gpu.peak(row["training"]["dtype"]) / 1e12


def compare(row: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Predicted against published for one row whose plan ran."""
    step = float(plan["step_s"])
    fits = plan.get("memory", {}).get("fits")
    measured = measured_step_s(row)
    if measured is not None:
        return {"status": "ok", "predicted_step_s": step, "measured_step_s": measured,
                "error": step / measured - 1, "fits": fits}  # fmt: skip
    predicted = predicted_metric(row, plan)
    error = float(row["measured"]["value"]) / predicted - 1
    return {"status": "ok", "predicted_step_s": step, "measured_step_s": None,
            "predicted_metric": predicted, "error": error, "fits": fits}  # fmt: skip


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
    if "step_s" not in plan or "mfu" not in plan:
        return {"status": "not supported", "reason": "the plan's JSON has no step_s or mfu"}
    return compare(row, plan)


def _subprocess(args: list[str]) -> tuple[int, str]:
    """`python -m ringtree ARGS` in a fresh process: the user's path."""
    done = subprocess.run([sys.executable, "-m", "ringtree", *args], cwd=ROOT, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def _in_process(args: list[str]) -> tuple[int, str]:
    """The same command line through the same CLI, in this process (no interpreter start per row)."""
    from typer.testing import CliRunner

    from ringtree.cli.app import app

    done = CliRunner().invoke(app, args)
    return done.exit_code, done.output


def run_cli(args: list[str], in_process: bool = False) -> tuple[int, str]:
    """Exit code and output of `ringtree ARGS`, in this process or a fresh one."""
    return (_in_process if in_process else _subprocess)(args)


def run_row(row: dict[str, Any], in_process: bool = False) -> dict[str, Any]:
    """Run the row's command and compare; never raises for what the planner refuses."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args = command(row, out)
        returncode, output = run_cli(args, in_process)
        plan = json.loads(out.read_text()) if out.exists() else None
    result = outcome(row, returncode, output, plan)
    return {"id": row["id"], "command": "ringtree " + " ".join([*args[:-1], "plan.json"]), **result}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, max and mean |error| over the rows that ran, and the counts."""
    errors = [abs(r["error"]) for r in results if r["status"] == "ok"]
    stats: dict[str, Any] = {"rows": len(results), "compared": len(errors)}
    stats["not_supported"] = sum(r["status"] == "not supported" for r in results)
    stats["failed"] = sum(r["status"] == "failed" for r in results)
    if errors:
        signed = [r["error"] for r in results if r["status"] == "ok"]
        stats["median_abs_error"] = statistics.median(errors)
        stats["max_abs_error"] = max(errors)
        stats["mean_abs_error"] = statistics.fmean(errors)
        stats["mean_error"] = statistics.fmean(signed)
    return stats


def _layout(row: dict[str, Any]) -> str:
    t = row["training"]
    parts = (
        [f"TP{t['tp']} PP{t['pp']}"]
        + [f"CP{t['cp']}" + (" all-gather" if t.get("cp_comm", "p2p") != "p2p" else "")] * (t["cp"] > 1)
        + [f"VP{t['virtual_stages']}"] * (t["virtual_stages"] > 1)
    )
    parts += ["SP"] * t["sequence_parallel"] + [f"ZeRO-{t['zero']}"] * (t["zero"] > 0)
    parts += [f"HSDP{t.get('shard_group')}"] * bool(t.get("shard_group")) + [t["recompute"]]
    return " ".join(parts)


def markdown(data: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The table of docs/results/planner-accuracy.md: one line per row, then the summary."""
    rows = {r["id"]: r for r in data["rows"]}
    out = ["| run | GPUs | layout | published | measured step (s) | predicted step (s) | error | fits |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        row = rows[r["id"]]
        gpus = f"{row['system']['gpus']} {row['system']['gpu'].split(' ')[0]}"
        published = f"{row['measured']['value']:g} {row['measured']['metric']}"
        if r["status"] != "ok":
            out.append(f"| {r['id']} | {gpus} | {_layout(row)} | {published} | | | {r['status']} | |")
            continue
        measured = f"{r['measured_step_s']:.3g}" if r["measured_step_s"] is not None else "-"
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        line = f"| {r['id']} | {gpus} | {_layout(row)} | {published} | {measured} |"
        out.append(f"{line} {r['predicted_step_s']:.3g} | {r['error']:+.1%} | {fits} |")
    s = summary(results)
    counts = f"{s['not_supported']} not supported, {s['failed']} failed"
    out.append(f"\n{s['compared']} of {s['rows']} rows compared ({counts})")
    if s["compared"]:
        out[-1] += f": median |error| {s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}, "
        out[-1] += f"mean |error| {s['mean_abs_error']:.1%}, mean signed {s['mean_error']:+.1%}"
    reasons = Counter(r["reason"] for r in results if r["status"] != "ok")
    out += [f"- {reason} ({n} rows)" for reason, n in reasons.most_common()]
    return "\n".join(out) + "\n"


SHORT = {
    "dgxc-24.11": "DGX Cloud", "dgxc-24.11-maxtext": "DGX Cloud, MaxText",
    "nemo-megatron-2022": "NeMo-Megatron launcher",
    "nemo-megatron-2022-07": "NeMo-Megatron launcher", "megatron-readme-2024": "Megatron-LM README",
    "torchtitan": "torchtitan", "bloom": "BLOOM", "mt-nlg": "MT-NLG", "llama3-paper": "Llama 3",
    "korthikanti-2022": "Korthikanti", "llm-foundry-benchmarks": "LLM Foundry",
}  # fmt: skip


def docs_table(data: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """docs/results/planner-accuracy.md's table of the rows: with each row's source, model and
    published words, then every row's command (a row on a machine its preset only approximates is
    marked with a dagger)."""
    rows = {r["id"]: r for r in data["rows"]}
    out = ["| run | source: where | model | GPUs | layout | published | measured step (s) | "
           "predicted step (s) | error | fits |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        row = rows[r["id"]]
        s = row["system"]
        gpus = f"{s['gpus']} {s['gpu'].split(' ')[0]}" + ("" if s.get("cluster_exact", True) else " †")
        where = f"{SHORT.get(row['source'], row['source'])}: {row['where']}"
        head = f"| {r['id']} | {where} | {row['model']['name']} | {gpus} | {_layout(row)} |"
        head += f" {row['measured']['as_published']} |"
        if r["status"] != "ok":
            out.append(f"{head} | | {r['status']} | |")
            continue
        measured = f"{r['measured_step_s']:.3g}" if r["measured_step_s"] is not None else "–"
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        out.append(f"{head} {measured} | {r['predicted_step_s']:.3g} | {r['error']:+.1%} | {fits} |")
    out += ["", "<details><summary>The command of every row (what the script runs)</summary>", "", "```"]
    for r in results:
        out += [f"# {r['id']}", r["command"]]
    return "\n".join([*out, "```", "", "</details>"]) + "\n"


def environment() -> dict[str, str]:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "ringtree_commit": rev.stdout.strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="The dataset (default: %(default)s).")
    parser.add_argument("--only", default="", help="Run only rows whose id contains this text.")
    parser.add_argument("--jobs", type=int, default=1, help="Commands run at once (default 1).")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="Run each command line through the CLI in this process (faster; default: a subprocess each).",
    )
    parser.add_argument("--json", type=Path, help="Write the results here.")
    parser.add_argument("--markdown", type=Path, help="Write the markdown table here.")
    parser.add_argument(
        "--docs", type=Path, help="Write the record's table (sources, models, commands) here."
    )
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
        record = {"environment": environment(), "summary": summary(results), "results": results}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    if args.docs:
        args.docs.write_text(docs_table(data, results))


if __name__ == "__main__":
    main()
