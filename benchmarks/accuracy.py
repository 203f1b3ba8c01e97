"""Predicted vs measured step time on emulated multi-node clusters (docs/results/emulated-sweeps.md).

For each inter-node rate and node count, an emulated bench of every algorithm across the link
(sizes bracketing the models' gradients) is fitted by `ringtree calibrate`, which keeps the rows:
the planner reads each algorithm's all-reduce time off its own rows at the gradient's size. Then,
round after round (`--repeats`), for each model: a 1-rank run on 1 emulated node (the speedup's
baseline), N ranks on ONE emulated node (the compute time at the CPU share the N-node run will
have), and, interleaved over node counts, algorithms and rates so that load drift hits every row
alike, `ringtree plan` predicts each N-node run BEFORE it runs (`ringtree emulate ... -- train`).
Each row is the median over rounds, with the spread. Every run has one rank per node and one
thread per rank (see docs/how-to/emulate-a-cluster.md). Needs root or CAP_NET_ADMIN. Run it under
the shared lock:

    flock /tmp/ringtree-bench.lock python benchmarks/accuracy.py --models mlp --nodes 2 \
        --rates 100mbit,1gbit,10gbit --algorithms ring,native
"""

from __future__ import annotations

import argparse
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
# --model fit: the planner before it read calibration rows (one alpha-beta fit; native as ring)
PLANNED_AS_BEFORE = {"native": "ring"}
BENCH_SIZES = ["--min-bytes", "16K", "--max-bytes", "1M", "--step-factor", "2"]  # mlp 104 kB, vit 277 kB


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


def calibrate(rate: str, tmp: Path, nodes: int, algorithms: list[str], replan: bool) -> Path:
    """An emulated bench of every algorithm across the link on `nodes` nodes, fitted by
    `ringtree calibrate` (with --replan, the kept bench rows are fitted again by today's code)."""
    rows, cal, record = (
        tmp / f"bench-{rate}{_n(nodes)}.json",
        tmp / f"cal-{rate}{_n(nodes)}.json",
        tmp / f"bench-{rate}{_n(nodes)}-cluster.json",
    )
    if not replan:
        bench = [
            "bench",
            "--algorithms",
            ",".join(algorithms),
            *BENCH_SIZES,
            "--iters",
            "20",
            "--warmup",
            "3",
        ]
        emulated(nodes, rate, [*bench, "--json", str(rows)], record)
    cal.unlink(missing_ok=True)
    one_node = tmp / f"bench-1node-{nodes}ranks.json"  # absent in sweeps before it was measured
    ringtree("calibrate", str(rows), *([str(one_node)] if one_node.exists() else []), "--out", str(cal))
    return cal


def bench_one_node(tmp: Path, ranks: int, algorithms: list[str]) -> None:
    """The same bench on `ranks` ranks of ONE emulated node (no shaped link): the calibration's
    rows for the shape of the N-rank baseline run, whose all-reduce the plan must tell apart from
    the rest of that run's exposed communication (its wait for ranks sharing the cores)."""
    bench = ["bench", "--algorithms", ",".join(algorithms), *BENCH_SIZES, "--iters", "20", "--warmup", "3"]
    out = tmp / f"bench-1node-{ranks}ranks.json"
    ringtree("emulate", "--nodes", "1", "--nproc-per-node", str(ranks), "--", *bench, "--json", str(out))


def ablated(cal: Path, model: str) -> Path:
    """The calibration as the planner sees it under --model: `rows` (all of it), `fit` (no
    measured rows, no per-algorithm fits: the planner before it read rows), `ring-rows` (only
    the ring's rows and fit: every other algorithm falls back to the overall fit)."""
    if model == "rows":
        return cal
    data = json.loads(cal.read_text())
    keep = "ring" if model == "ring-rows" else None
    data["measured"] = [r for r in data.get("measured", []) if r["algorithm"] == keep]
    data["algorithms"] = {k: v for k, v in data.get("algorithms", {}).items() if k == keep}
    out = cal.with_name(f"{cal.stem}-{model}.json")
    out.write_text(json.dumps(data))
    return out


def _n(nodes: int) -> str:
    return "" if nodes == 2 else f"-{nodes}nodes"  # 2-node files keep the first sweep's names


def predict(
    summary: dict[str, Any], compute: float | Path, nodes: int, algorithm: str, cal: Path, tag: str = ""
) -> dict[str, Any]:
    """The plan's JSON for this many nodes (its step time and all-reduce time are what we compare):
    from a compute time, or `plan --from-run` of the N-rank baseline run (compute and its wait)."""
    out = cal.with_name(f"plan-{summary['model']}-{nodes}-{algorithm}-{cal.stem}{tag}.json")
    cluster = ["--nodes", str(nodes), "--gpus-per-node", "1", "--calibration", str(cal),
               "--algorithm", planned_as(algorithm, cal), "--json", str(out)]  # fmt: skip
    if isinstance(compute, Path):
        ringtree("plan", "--from-run", str(compute), *cluster)
    else:
        ringtree(
            "plan", "--params", str(summary["parameters"]), "--compute-time", f"{compute:.6g}", *cluster,
            "--overlap", "--bucket-mb", str(summary["bucket_mb"]), "--batch-size", str(summary["batch_size"]),
        )  # fmt: skip
    plan: dict[str, Any] = json.loads(out.read_text())
    return plan


def planned_as(algorithm: str, cal: Path) -> str:
    """The algorithm the plan is asked for: itself, or ring for native under --model fit."""
    return PLANNED_AS_BEFORE.get(algorithm, algorithm) if cal.stem.endswith("-fit") else algorithm


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every row; the JSON is rewritten after each round, so an interrupted sweep keeps its rows.

    Calibrations first (one per rate and node count), then `--repeats` rounds; in each, per
    model, the two baselines and then every (nodes, algorithm, rate) run, rates innermost. With
    --replan nothing runs: the rows are rebuilt from the measurements kept in `work`, with
    predictions from today's calibration and planner (to check a model change against the same
    measurements).
    """
    links: dict[str, Any] = {}
    cals: dict[tuple[str, int], Path] = {}
    rounds = args.rounds if args.rounds is not None else list(range(args.repeats))
    measure = not args.replan and 0 in rounds  # later rounds reuse the sweep's calibration benches
    if measure:
        for nodes in args.nodes:
            bench_one_node(work, nodes, args.bench_algorithms or args.algorithms)
    for rate in args.rates:
        for nodes in [2] if args.calibrate_on == "two" else args.nodes:
            cal = calibrate(rate, work, nodes, args.bench_algorithms or args.algorithms, not measure)
            cals[rate, nodes] = ablated(cal, args.model)
            record = json.loads((work / f"bench-{rate}{_n(nodes)}-cluster.json").read_text())
            links[f"{rate} x {nodes} nodes"] = record["links"]
    cells: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for k in rounds:
        for model in args.models:
            one = baseline(model, 1, k, args, work)
            t1 = float(one["step_time_s"])  # one rank: no communication, the step is compute
            compute = {n: plan_input(model, n, k, t1, args, work) for n in args.nodes}
            for nodes in args.nodes:
                for algorithm in args.algorithms:
                    for rate in args.rates:
                        cal = cals[rate, 2 if args.calibrate_on == "two" else nodes]
                        predicted = predict(
                            one, compute[nodes], nodes, algorithm, cal, _r(k)
                        )  # before the run
                        out = work / f"{model}-{nodes}-{rate}-{algorithm}{_r(k)}.json"
                        if not args.replan:
                            emulated(nodes, rate, train(model, algorithm, args.epochs, out), work / "c.json")
                        if not out.exists():
                            continue  # --replan of a sweep that was stopped early
                        measured = json.loads(out.read_text())
                        load = None if args.replan else os.getloadavg()[0]  # right after the run
                        cell = row(model, nodes, rate, algorithm, t1, predicted, measured, cal, load)
                        cells.setdefault((model, nodes, rate, algorithm), []).append(cell)
                        print(json.dumps(cell), flush=True)
        rows = [median_row(v) for v in sorted(cells.values(), key=_order(args))]
        save(args.out, rows, links)
    return save(args.out, rows, links)


def _order(args: argparse.Namespace) -> Any:
    """Table order: model, rate, nodes, algorithm as given on the command line."""

    def key(runs: list[dict[str, Any]]) -> tuple[int, ...]:
        r = runs[0]
        return (args.models.index(r["model"]), args.rates.index(r["inter_bw"]), args.nodes.index(r["nodes"]),
                args.algorithms.index(r["algorithm"]))  # fmt: skip

    return key


def _r(k: int) -> str:
    return "" if k == 0 else f"-r{k}"  # round 0 keeps the first sweeps' file names


def baseline(model: str, ranks: int, k: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A run of `ranks` ranks on ONE emulated node (no shaped link between them, one thread each)."""
    path = baseline_path(model, ranks, k, work)
    if not args.replan:
        command = train(model, "ring", args.epochs, path)
        ringtree("emulate", "--nodes", "1", "--nproc-per-node", str(ranks), "--", *command)
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def baseline_path(model: str, ranks: int, k: int, work: Path) -> Path:
    name = "1node" if ranks == 1 else f"1node-{ranks}ranks"
    return work / f"{model}-{name}{_r(k)}.json"


def plan_input(
    model: str, nodes: int, k: int, t1: float, args: argparse.Namespace, work: Path
) -> float | Path:
    """What the plan starts from: the 1-rank step (`one-rank`), or N ranks sharing this machine's
    cores on ONE node: its compute (`same-ranks`: step less exposed communication) or the run
    itself (`from-run`: `plan --from-run`, compute plus the run's wait beyond its own all-reduce).

    N ranks of one emulated node load the cores as the N-node run will, and wait for each other
    as its ranks will; on a real cluster, where nodes do not share cores, the N-rank baseline is
    one node's run. Measured in every round, right before that round's N-node runs, so that both
    see the same machine.
    """
    if args.compute_from == "one-rank":
        return t1
    run = baseline(model, nodes, k, args, work)
    path = baseline_path(model, nodes, k, work)
    return path if args.compute_from == "from-run" else float(run["step_time_s"] - run["exposed_comm_time_s"])


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the rounds of one cell: medians of every number, and the spread of the
    measured step ((max - min) / median). The error and the pays-off verdict are the medians'."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float) and all(r.get(key) is not None for r in runs):
            out[key] = statistics.median(float(r[key]) for r in runs)
    steps = [r["measured_step_s"] for r in runs]
    t1, n = out["one_node_step_s"], out["nodes"]
    out.update(
        repeats=len(runs),
        measured_steps_s=steps,
        measured_spread=(max(steps) - min(steps)) / statistics.median(steps),
        error=out["predicted_step_s"] / out["measured_step_s"] - 1,
        predicted_speedup=n * t1 / out["predicted_step_s"],
        measured_speedup=n * t1 / out["measured_step_s"],
    )
    out["pays_off_predicted_correctly"] = (out["predicted_speedup"] > 1) == (out["measured_speedup"] > 1)
    return out


def save(path: Path, rows: list[dict[str, Any]], links: dict[str, Any]) -> dict[str, Any]:
    result = {"environment": environment(), "links": links, "rows": rows, "summary": summary(rows)}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def row(
    model: str,
    nodes: int,
    rate: str,
    algorithm: str,
    t1: float,
    plan: dict[str, Any],
    run: dict[str, Any],
    cal: Path,
    load: float | None = None,
) -> dict[str, Any]:
    """One comparison. Speedup = N nodes' samples/s over one node's = N x t1 / t_N (batch per rank fixed).

    The breakdown says where a miss comes from: the planner's all-reduce against the run's
    measured communication, and the run's compute (its step less the exposed communication)
    against the one-node step it was predicted from.
    """
    predicted = float(plan["step_s"])
    measured = float(run["step_time_s"])
    return {
        "model": model,
        "nodes": nodes,
        "inter_bw": rate,
        "algorithm": algorithm,
        "planned_as": planned_as(algorithm, cal),
        "one_node_step_s": t1,
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "error": predicted / measured - 1,
        "predicted_speedup": nodes * t1 / predicted,
        "measured_speedup": nodes * t1 / measured,
        "pays_off_predicted_correctly": (nodes * t1 / predicted > 1) == (nodes * t1 / measured > 1),
        "predicted_compute_s": plan["breakdown"]["compute_s"],
        "predicted_allreduce_s": plan["dp_allreduce_s"],
        "predicted_wait_s": plan.get("sync_wait_s", 0.0),
        "predicted_error_bar_s": (plan.get("explain") or {}).get("error_bar_s"),
        "measured_comm_s": run["comm_time_s"],
        "measured_exposed_comm_s": run["exposed_comm_time_s"],
        "measured_compute_s": measured - run["exposed_comm_time_s"],
        "load_average_1m": load,  # right after the run (None when replanned)
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows]
    return {
        "rows": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "pays_off_correct": sum(r["pays_off_predicted_correctly"] for r in rows),
        "median_measured_spread": statistics.median(r.get("measured_spread", 0.0) for r in rows)
        if rows
        else None,
    }


def environment() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{os.cpu_count()}-core VM, one rank per emulated node, 1 thread per rank "
        "(each row records the 1-minute load average right after its run)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "flock /tmp/ringtree-bench.lock python benchmarks/accuracy.py " + " ".join(sys.argv[1:]),
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of docs/results/emulated-sweeps.md's "Emulated multi-node" section."""
    lines = [
        "| model | nodes | inter-node | algorithm | 1-node step (ms) | predicted (ms) | measured (ms) "
        "| error | speedup predicted | speedup measured | pays off? | all-reduce predicted / measured (ms) "
        "| wait kept (ms) | compute predicted / measured (ms) | spread |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
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
            _ms(r.get("predicted_wait_s")),
            f"{_ms(r['predicted_compute_s'])} / {_ms(r['measured_compute_s'])}",
            f"{r.get('measured_spread', 0.0) * 100:.0f}%",
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
    parser.add_argument("--repeats", type=int, default=1, help="Rounds; each row is their median.")
    parser.add_argument(
        "--rounds",
        type=lambda s: [int(k) for k in s.split(",")],
        help="Which rounds (0, 1, ...; default all of --repeats): run only these, reusing the kept "
        "calibration benches unless 0 is among them; with --replan, the rows are these rounds' medians.",
    )
    parser.add_argument(
        "--bench-algorithms",
        type=lambda s: s.split(","),
        help="Algorithms of the calibration bench (default: --algorithms).",
    )
    parser.add_argument(
        "--model",
        choices=["rows", "fit", "ring-rows"],
        default="rows",
        help="What the planner may use of the calibration: everything (rows), the ring's rows "
        "only, or the alpha-beta fit alone with native planned as ring (the model before rows).",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs/data/accuracy.json")
    parser.add_argument(
        "--compute-from",
        choices=["one-rank", "same-ranks", "from-run"],
        default="from-run",
        help="What the plan starts from: the 1-rank run's step, the compute of N ranks sharing one "
        "node's cores, or that run itself (`plan --from-run`: its compute and its wait).",
    )
    parser.add_argument(
        "--calibrate-on",
        choices=["two", "run-nodes"],
        default="run-nodes",
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
