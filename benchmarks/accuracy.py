"""Predicted vs measured step time on emulated multi-node clusters (docs/accuracy.md).

For each model: one run on 1 emulated node gives the compute time per step; for each inter-node
rate, an emulated 2-node bench across the link is fitted by `ringtree calibrate`; then, BEFORE
each multi-node run, `ringtree plan` predicts its step time from those two, and the run
(`ringtree emulate ... -- train`) measures it. Every run has one rank per node and one thread per
rank (see docs/emulate.md). Needs root or CAP_NET_ADMIN. Run it under the shared lock:

    flock /tmp/ringtree-bench.lock python benchmarks/accuracy.py --models mlp --nodes 2 \
        --rates 100mbit,1gbit,10gbit --algorithms ring,native

"native" (gloo's own all-reduce) has no closed form in the planner; it is predicted as ring.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLANNED_AS = {"native": "ring"}  # the planner models gloo's native all-reduce as a ring


def ringtree(*args: str) -> None:
    """Run `python -m ringtree ARGS`, failing loudly with its output."""
    done = subprocess.run([sys.executable, "-m", "ringtree", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ringtree {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def emulated(nodes: int, rate: str, command: list[str], record: Path) -> None:
    ringtree("emulate", "--nodes", str(nodes), "--inter-bw", rate, "--json", str(record), "--", *command)


def train(model: str, algorithm: str, epochs: int, out: Path) -> list[str]:
    args = ["train", "--model", model, "--algorithm", algorithm, "--epochs", str(epochs)]
    return [*args, "--no-progress", "--json", str(out)]


def calibrate(rate: str, tmp: Path, nodes: int = 2) -> Path:
    """An emulated ring bench across the link on `nodes` nodes, fitted by today's `ringtree calibrate`."""
    rows, cal, record = (
        tmp / f"bench-{rate}{_n(nodes)}.json",
        tmp / f"cal-{rate}{_n(nodes)}.json",
        tmp / f"bench-{rate}{_n(nodes)}-cluster.json",
    )
    bench = ["bench", "--algorithms", "ring", "--min-bytes", "4K", "--max-bytes", "4M", "--step-factor", "4"]
    emulated(nodes, rate, [*bench, "--iters", "5", "--warmup", "2", "--json", str(rows)], record)
    ringtree("calibrate", str(rows), "--out", str(cal))
    return cal


def _n(nodes: int) -> str:
    return "" if nodes == 2 else f"-{nodes}nodes"  # 2-node files keep the first sweep's names


def predict(
    summary: dict[str, Any], compute_s: float, nodes: int, algorithm: str, cal: Path
) -> dict[str, Any]:
    """The plan's JSON for this many nodes (its step time and all-reduce time are what we compare)."""
    out = cal.with_name(f"plan-{summary['model']}-{nodes}-{algorithm}-{cal.stem}.json")
    ringtree(
        "plan", "--params", str(summary["parameters"]), "--compute-time", f"{compute_s:.6g}",
        "--nodes", str(nodes), "--gpus-per-node", "1", "--calibration", str(cal),
        "--algorithm", PLANNED_AS.get(algorithm, algorithm), "--overlap",
        "--bucket-mb", str(summary["bucket_mb"]), "--batch-size", str(summary["batch_size"]),
        "--json", str(out),
    )  # fmt: skip
    plan: dict[str, Any] = json.loads(out.read_text())
    return plan


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every row; the JSON is rewritten after each one, so an interrupted sweep keeps its rows.

    With --replan nothing runs: the rows are rebuilt from the measurements kept in `work`, with
    predictions from today's planner (to check a model change against the same measurements).
    """
    rows: list[dict[str, Any]] = []
    links: dict[str, Any] = {}
    cals: dict[tuple[str, int], Path] = {}
    for rate in args.rates:
        for nodes in [2] if args.calibrate_on == "two" else args.nodes:
            cals[rate, nodes] = work / f"cal-{rate}{_n(nodes)}.json"
            if not args.replan:
                calibrate(rate, work, nodes)
            record = json.loads((work / f"bench-{rate}{_n(nodes)}-cluster.json").read_text())
            links[f"{rate} x {nodes} nodes"] = record["links"]
    for model in args.models:
        base = work / f"{model}-1node.json"
        if not args.replan:
            emulated(1, args.rates[0], train(model, "ring", args.epochs, base), work / "c.json")
        one = json.loads(base.read_text())
        t1 = one["step_time_s"]  # one rank: no communication, the step is compute
        for rate in args.rates:
            for nodes in args.nodes:
                compute_s = (
                    t1 if args.compute_from == "one-rank" else shared_compute(model, nodes, rate, args, work)
                )
                for algorithm in args.algorithms:
                    cal = cals[rate, 2 if args.calibrate_on == "two" else nodes]
                    predicted = predict(one, compute_s, nodes, algorithm, cal)  # before the run
                    out = work / f"{model}-{nodes}-{rate}-{algorithm}.json"
                    if not args.replan:
                        emulated(nodes, rate, train(model, algorithm, args.epochs, out), work / "c.json")
                    if not out.exists():
                        continue  # --replan of a sweep that was stopped early
                    measured = json.loads(out.read_text())
                    rows.append(row(model, nodes, rate, algorithm, t1, predicted, measured))
                    print(json.dumps(rows[-1]), flush=True)
                    save(args.out, rows, links)
    return save(args.out, rows, links)


def shared_compute(model: str, nodes: int, rate: str, args: argparse.Namespace, work: Path) -> float:
    """Compute per step with N ranks sharing this machine's cores, measured on ONE node.

    N ranks of one emulated node (loopback between them, one thread each) load the cores as the
    N-node run will; their step less its exposed communication is the compute the N-node run's
    ranks will see. On a real cluster, where nodes do not share cores, this equals the 1-rank step.
    Measured again right before each group of N-node runs, so that both see the same machine.
    """
    path = work / f"{model}-1node-{nodes}ranks-before-{rate}.json"
    if not args.replan:
        command = train(model, "ring", args.epochs, path)
        ringtree("emulate", "--nodes", "1", "--nproc-per-node", str(nodes), "--", *command)
    run = json.loads(path.read_text())
    return float(run["step_time_s"] - run["exposed_comm_time_s"])


def save(path: Path, rows: list[dict[str, Any]], links: dict[str, Any]) -> dict[str, Any]:
    result = {"environment": environment(), "links": links, "rows": rows, "summary": summary(rows)}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def row(
    model: str, nodes: int, rate: str, algorithm: str, t1: float, plan: dict[str, Any], run: dict[str, Any]
) -> dict[str, Any]:
    """One comparison. Speedup = N nodes' samples/s over one node's = N x t1 / t_N (batch per rank fixed).

    The breakdown says where a miss comes from: the planner's all-reduce against the run's
    measured communication, and the run's compute (its step less the exposed communication)
    against the one-node step it was predicted from.
    """
    predicted = float(plan.get("step_s", plan.get("step_time_s")))
    measured = float(run["step_time_s"])
    return {
        "model": model,
        "nodes": nodes,
        "inter_bw": rate,
        "algorithm": algorithm,
        "planned_as": PLANNED_AS.get(algorithm, algorithm),
        "one_node_step_s": t1,
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "error": predicted / measured - 1,
        "predicted_speedup": nodes * t1 / predicted,
        "measured_speedup": nodes * t1 / measured,
        "pays_off_predicted_correctly": (nodes * t1 / predicted > 1) == (nodes * t1 / measured > 1),
        "predicted_compute_s": plan["compute_time_s"],
        "predicted_allreduce_s": plan["allreduce_time_s"],
        "measured_comm_s": run["comm_time_s"],
        "measured_exposed_comm_s": run["exposed_comm_time_s"],
        "measured_compute_s": measured - run["exposed_comm_time_s"],
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows]
    return {
        "rows": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "pays_off_correct": sum(r["pays_off_predicted_correctly"] for r in rows),
    }


def environment() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": "shared 2-core VM (other jobs running), one rank per emulated node, 1 thread per rank",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "flock /tmp/ringtree-bench.lock python benchmarks/accuracy.py " + " ".join(sys.argv[1:]),
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of docs/accuracy.md's "Emulated multi-node" section."""
    lines = [
        "| model | nodes | inter-node | algorithm | 1-node step (ms) | predicted (ms) | measured (ms) "
        "| error | speedup predicted | speedup measured | pays off? | all-reduce predicted / measured (ms) "
        "| compute predicted / measured (ms) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        ok = "right" if r["pays_off_predicted_correctly"] else "WRONG"
        cells = [
            r["model"],
            r["nodes"],
            r["inter_bw"],
            r["algorithm"],
            f"{r['one_node_step_s'] * 1e3:.1f}",
            f"{r['predicted_step_s'] * 1e3:.1f}",
            f"{r['measured_step_s'] * 1e3:.1f}",
            f"{r['error'] * 100:+.0f}%",
            f"{r['predicted_speedup']:.2f}x",
            f"{r['measured_speedup']:.2f}x",
            ok,
            f"{_ms(r['predicted_allreduce_s'])} / {_ms(r['measured_comm_s'])}",
            f"{_ms(r['predicted_compute_s'])} / {_ms(r['measured_compute_s'])}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp"])
    parser.add_argument("--nodes", type=lambda s: [int(n) for n in s.split(",")], default=[2])
    parser.add_argument("--rates", type=lambda s: s.split(","), default=["100mbit", "1gbit", "10gbit"])
    parser.add_argument("--algorithms", type=lambda s: s.split(","), default=["ring", "native"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/data/accuracy.json")
    parser.add_argument(
        "--compute-from",
        choices=["one-rank", "same-ranks"],
        default="one-rank",
        help="Compute time for the plan: the 1-rank run's step, or N ranks sharing one node's cores.",
    )
    parser.add_argument(
        "--calibrate-on",
        choices=["two", "run-nodes"],
        default="two",
        help="Calibrate from a 2-node bench, or from a bench on as many nodes as the run.",
    )
    parser.add_argument("--table-from", type=Path, help="Only print the table of an earlier --out file.")
    parser.add_argument(
        "--workdir", type=Path, help="Keep every run's files here (default: a temporary folder)."
    )
    parser.add_argument(
        "--replan", action="store_true", help="Rebuild the rows from --workdir, predicting anew."
    )
    args = parser.parse_args()
    if args.table_from:
        result = json.loads(args.table_from.read_text())
    elif args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="ringtree-accuracy-") as name:
            result = run(args, Path(name))
    print(table(result))
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
