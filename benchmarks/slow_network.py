"""Training across a slow network, measured: DDP against the methods that synchronise less
(docs/results/synchronising-less.md).

Three emulated nodes, one rank each (`ringtree emulate --nodes 3 --nproc-per-node 1`), their links
shaped at each `--rates` value. Every method trains the same model on the same samples (same epochs,
batch and seed): by default `wide-mlp` (`ringtree.train.models:wide_mlp`, 216,586 parameters, 866 kB
of fp32 gradients) on all of each rank's 480 digits a step, so that DDP's step at 100 Mbit/s is
mostly communication. The methods: DDP, DDP with bf16 buckets, PowerSGD (rank 4), local SGD, DiLoCo
(H = 16 and 64) and Streaming DiLoCo (4 fragments, one overlapped step, fp8 on the wire), and
`compute`, the same three ranks without communication (local SGD that averages only at the start
and the end), whose samples/s is the denominator of every compute utilisation. For each run:
samples/s, the bytes each node's interface really sent during the job (the kernel's counters, from
`ringtree emulate --json`'s `link_bytes`, not ringtree's own bookkeeping) per optimizer step and
per synchronisation between the replicas (the run's bytes less the compute run's, over the syncs it
made beyond the compute run's), held-out loss and accuracy, and the planner's samples/s for the same
method (`ringtree plan --module ... --compute-time T --calibration C --sync ...`, T the compute run's
step, C the shaped links as `ringtree bench` of the trainer's ring measured them on the same emulated
cluster, fitted by `ringtree calibrate`; PowerSGD's own compression work, which is compute, as its run
measured it: `--powersgd-compute-time`), set beside the measurement. Rounds interleave the methods
so that load drift hits every row alike; each row is the median over rounds. Needs root or
CAP_NET_ADMIN. Run it alone, under the shared lock:

    flock /tmp/ringtree-bench.lock python benchmarks/slow_network.py --json docs/data/slow-network.json
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
from pathlib import Path
from typing import Any

from ringtree.emulate import cpu

ROOT = Path(__file__).resolve().parents[1]
NODES = 3
# model -> (what `train --model` takes, the planner's `--module`: it counts and splits its tensors)
MODELS = {
    "wide-mlp": ("ringtree.train.models:wide_mlp", "ringtree.train.models:wide_mlp"),
    "mlp": ("mlp", "ringtree.train.models:MLP"),
}

# method -> the train flags that select it (every run adds the same model, data and budget)
METHODS: dict[str, list[str]] = {
    "compute": ["--sync", "local-sgd", "--inner-steps", "1000000"],  # averages only at the start and the end
    "ddp": [],
    "ddp-bf16": ["--compression", "bf16"],
    "powersgd-r4": ["--compression", "powersgd", "--powersgd-rank", "4", "--powersgd-start-iter", "10"],
    "local-sgd-h16": ["--sync", "local-sgd", "--inner-steps", "16"],
    "diloco-h16": ["--sync", "diloco", "--inner-steps", "16"],
    "diloco-h64": ["--sync", "diloco", "--inner-steps", "64"],
    "streaming-f4": [
        *("--sync", "streaming-diloco", "--inner-steps", "64", "--fragments", "4"),
        *("--overlap-steps", "1", "--outer-dtype", "fp8"),
    ],
}
# a Streaming DiLoCo method -> the DiLoCo method of the same H its bytes per sync are measured against
STREAMING_BASE = {"streaming-f4": "diloco-h64"}
# method -> the planner's words for it, where they differ from train's (--sync is the same word)
PLANNED: dict[str, list[str]] = {
    "compute": [],
    "ddp": ["--sync", "ddp"],
    "ddp-bf16": ["--sync", "ddp", "--grad-dtype", "bf16"],
    "powersgd-r4": ["--sync", "powersgd", "--powersgd-rank", "4"],
}


def ringtree(*args: str) -> str:
    """Run `python -m ringtree ARGS`, failing loudly with its output; its stdout."""
    done = subprocess.run([sys.executable, "-m", "ringtree", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ringtree {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def train_args(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    budget = ["--model", MODELS[args.model][0], "--epochs", str(args.epochs), "--seed", str(args.seed)]
    if args.batch_size:
        budget += ["--batch-size", str(args.batch_size)]
    return ["train", *budget, *METHODS[method], "--no-progress", "--json", str(out)]


def measure(
    args: argparse.Namespace, method: str, rate: str, work: Path, tag: str, links: dict[str, Any]
) -> dict[str, Any]:
    """One emulated run: its summary and the cluster record's interface counters. The first run on
    each rate also measures the shaped links (`links[rate]`), which the planner is given."""
    summary_path, record_path = (
        work / f"{method}-{rate}{tag}.json",
        work / f"{method}-{rate}{tag}-cluster.json",
    )
    emulate = ["emulate", "--nodes", str(NODES), "--nproc-per-node", "1", "--inter-bw", rate]
    emulate += ["--cpus-per-node", args.cpus_per_node]
    emulate += [*(["--no-measure"] if rate in links else []), "--json", str(record_path), "--"]
    ringtree(*emulate, *train_args(args, method, summary_path))
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    record: dict[str, Any] = json.loads(record_path.read_text())
    links.setdefault(rate, record["links"])
    steps = int(summary["steps"])
    sent = [n["sent"] for n in record["link_bytes"]]
    return {
        "method": method,
        "model": args.model,
        "inter_bw": rate,
        "samples_per_s": float(summary["samples_per_s"]),
        "step_time_s": float(summary["step_time_s"]),
        "steps": steps,
        "accuracy": summary.get("accuracy"),
        "test_loss": summary.get("test_loss"),
        "link_bytes_per_step": statistics.mean(sent) / steps,  # one rank per node: what a rank sent
        "reported_bytes_per_step": summary.get("inter_node_bytes_per_step"),
        "parameters": int(summary["parameters"]),
        "global_batch": int(summary["batch_size"]) * int(summary["world_size"]),
        "algorithm": str(summary["algorithm"]),
        "outer_syncs": summary.get("outer_syncs"),
        "sync_wait_s": summary.get("outer_sync_wait_s"),  # per sync, waiting for the last replica
        "powersgd_compute_s": summary.get("powersgd_compute_s"),  # its own work per step, measured
        # the share of its own steps the run did not wait for communication (DDP's gradients, the
        # outer syncs): a utilisation measured inside one run, which load drifting between runs spares
        "in_run_utilisation": 1.0
        - (
            float(summary.get("exposed_comm_time_s") or 0.0)
            + float(summary.get("outer_comm_exposed_s") or 0.0)
        )
        / float(summary["step_time_s"]),
    }


def calibrate(rate: str, work: Path, cpus_per_node: str) -> dict[str, Any]:
    """The shaped links as ringtree's own all-reduce sees them: `ringtree bench` of the trainer's
    ring on the emulated cluster, 1 KiB to 4 MiB, fitted by `ringtree calibrate` (the file the
    planner's `--calibration` reads: the fitted link and the measured times)."""
    bench, fitted = work / f"bench-{rate}.json", work / f"calibration-{rate}.json"
    ringtree(
        "emulate", "--nodes", str(NODES), "--nproc-per-node", "1", "--inter-bw", rate, "--no-measure",
        "--cpus-per-node", cpus_per_node, "--",
        "bench", "--algorithms", "ring", "--min-bytes", "1K", "--max-bytes", "4M", "--step-factor", "4",
        "--iters", "10", "--json", str(bench),
    )  # fmt: skip
    ringtree("calibrate", str(bench), "--out", str(fitted))
    return {"bench": json.loads(bench.read_text()), "fit": json.loads(fitted.read_text())}


def planned(row: dict[str, Any], compute: dict[str, Any], calibration: dict[str, Any]) -> tuple[float, float]:
    """The planner's samples/s for the row and its ratio to the measured one, each the median over
    the rounds both the row and the compute run have, every round's prediction made from that
    round's compute step (and a PowerSGD run's own work): rounds that ran on a faster or slower
    host are compared with themselves. With no round in common, from the medians."""
    step = dict(zip(compute["round_ids"], compute["step_time_s_all"], strict=True))
    runs = zip(row["round_ids"], row["samples_per_s_all"], row["powersgd_compute_s_all"], strict=True)
    shared = [(step[k], sps, work) for k, sps, work in runs if k in step] or [
        (compute["step_time_s"], row["samples_per_s"], row.get("powersgd_compute_s"))
    ]
    predicted = [predicted_samples_per_s(row, calibration, t, work) for t, _, work in shared]
    ratios = [p / sps for p, (_, sps, _) in zip(predicted, shared, strict=True)]
    return statistics.median(predicted), statistics.median(ratios)


def predicted_samples_per_s(
    row: dict[str, Any], calibration: dict[str, Any], compute_step_s: float, work_s: float | None
) -> float:
    """The planner's samples/s for the row's method on the calibrated links, from the compute run's
    step (and PowerSGD's from its own work per step, which its run measures, as the step's is in
    the compute run)."""
    method = row["method"]
    work = [] if work_s is None else ["--powersgd-compute-time", f"{work_s:.6g}"]
    with tempfile.TemporaryDirectory() as tmp:
        out, fitted = Path(tmp) / "plan.json", Path(tmp) / "calibration.json"
        fitted.write_text(json.dumps(calibration["fit"]))
        ringtree(
            "plan", "--module", MODELS[row["model"]][1], "--compute-time", f"{compute_step_s:.6g}",
            "--nodes", str(NODES), "--gpus-per-node", "1", "--intra", "pcie-gen3",
            "--calibration", str(fitted), "--algorithm", row["algorithm"],
            *PLANNED.get(method, METHODS[method]), *work,
            "--json", str(out),
        )  # fmt: skip
        plan: dict[str, Any] = json.loads(out.read_text())
    step = float(plan["sync"]["step_s"])  # the method's step: inner step and its share of the syncs
    return float(row["global_batch"]) / step


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    medians = ("samples_per_s", "step_time_s", "link_bytes_per_step", "accuracy", "test_loss", "sync_wait_s")
    medians += ("in_run_utilisation", "powersgd_compute_s")
    for key in medians:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["rounds"] = len(runs)
    out["round_ids"] = [r.get("round", 0) for r in runs]
    out["samples_per_s_all"] = [r["samples_per_s"] for r in runs]
    out["step_time_s_all"] = [r["step_time_s"] for r in runs]
    out["powersgd_compute_s_all"] = [r.get("powersgd_compute_s") for r in runs]
    return out


def summarise(rows: list[dict[str, Any]], calibrations: dict[str, Any]) -> list[dict[str, Any]]:
    """Compute utilisation, bytes against DDP's, the planner beside each row."""
    for rate in sorted({r["inter_bw"] for r in rows}):
        mine = {r["method"]: r for r in rows if r["inter_bw"] == rate}
        compute, ddp = mine.get("compute"), mine.get("ddp")
        for r in mine.values():
            if compute:
                r["compute_utilisation"] = per_round_ratio(r, compute)
            if compute and r["method"] != "compute":
                r["predicted_samples_per_s"], r["predicted_over_measured"] = planned(
                    r, compute, calibrations[rate]
                )
            if compute and r.get("outer_syncs") and r["method"] not in STREAMING_BASE:
                r["link_bytes_per_sync"] = bytes_per_sync(r, compute)
            if ddp:
                r["speed_vs_ddp"] = per_round_ratio(r, ddp)
                r["bytes_vs_ddp"] = r["link_bytes_per_step"] / ddp["link_bytes_per_step"]
                if r["accuracy"] is not None and ddp["accuracy"] is not None:
                    r["accuracy_vs_ddp_points"] = 100 * (r["accuracy"] - ddp["accuracy"])
        for method, base in STREAMING_BASE.items():
            if method in mine and mine.get(base, {}).get("link_bytes_per_sync"):
                mine[method]["link_bytes_per_sync"] = fragment_bytes_per_sync(mine[method], mine[base])
                mine[method]["sync_bytes_vs_diloco"] = (
                    mine[method]["link_bytes_per_sync"] / mine[base]["link_bytes_per_sync"]
                )
    return rows


def per_round_ratio(row: dict[str, Any], base: dict[str, Any]) -> float:
    """The median over rounds of the row's samples/s over the base's in the same round (the load
    of a round hits both alike); the ratio of the medians when no round has both."""
    mine = dict(zip(row["round_ids"], row["samples_per_s_all"], strict=True))
    theirs = dict(zip(base["round_ids"], base["samples_per_s_all"], strict=True))
    ratios = [mine[k] / theirs[k] for k in mine if k in theirs and theirs[k] > 0]
    return statistics.median(ratios) if ratios else row["samples_per_s"] / base["samples_per_s"]


def bytes_per_sync(row: dict[str, Any], compute: dict[str, Any]) -> float | None:
    """What one synchronisation between the replicas put on the interface: the run's bytes less the
    compute run's (the same start, end and small collectives, one sync fewer per sync it lacks),
    over the syncs the run made beyond the compute run's."""
    extra = int(row["outer_syncs"]) - int(compute["outer_syncs"])
    if extra <= 0:
        return None
    more = row["link_bytes_per_step"] * row["steps"] - compute["link_bytes_per_step"] * compute["steps"]
    return float(more) / extra


def fragment_bytes_per_sync(row: dict[str, Any], diloco: dict[str, Any]) -> float:
    """What one fragment's synchronisation put on the interface: Streaming DiLoCo's bytes less
    DiLoCo's at the same H (the same start and small collectives), plus DiLoCo's own syncs (their
    bytes per sync measured against the compute run), over the fragment syncs. Both end with every
    fragment synchronised, the fragments that did not just synchronise in Streaming's dtype."""
    less = row["link_bytes_per_step"] * row["steps"] - diloco["link_bytes_per_step"] * diloco["steps"]
    return float(less + int(diloco["outer_syncs"]) * diloco["link_bytes_per_sync"]) / int(row["outer_syncs"])


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as the results page shows them (markdown)."""

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = [
        "| link | method | samples/s | compute util. | x DDP | bytes/step (interface) | x DDP's | "
        "bytes/sync | accuracy | vs DDP (points) | test loss | planner samples/s | planner / measured | "
        "wait for the last replica (ms/sync) | not waiting (in-run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["inter_bw"],
            r["method"],
            f(r["samples_per_s"], ",.0f"),
            f(r.get("compute_utilisation"), ".0%"),
            f(r.get("speed_vs_ddp"), ".2f"),
            f(r["link_bytes_per_step"], ",.0f"),
            f(r.get("bytes_vs_ddp"), ".4f"),
            f(r.get("link_bytes_per_sync"), ",.0f"),
            f(r["accuracy"], ".4f"),
            f(r.get("accuracy_vs_ddp_points"), "+.1f"),
            f(r["test_loss"], ".3f"),
            f(r.get("predicted_samples_per_s"), ",.0f"),
            f(r.get("predicted_over_measured"), ".2f"),
            f(None if r.get("sync_wait_s") is None else 1000 * r["sync_wait_s"], ".0f"),
            f(r.get("in_run_utilisation"), ".0%"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def environment() -> dict[str, Any]:
    import torch

    return {
        "host": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0],
        "ranks_on_cores": sorted(os.sched_getaffinity(0)),
        "command": " ".join(["python", *sys.argv]),
    }


def refuse(message: str) -> None:
    """Bad input: one sentence on stderr, exit 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="Write the rows here.")
    p.add_argument("--table", action="store_true", help="Only print --json's rows as a markdown table.")
    p.add_argument(
        "--append", action="store_true", help="Add --repeats rounds to --json's .runs.json (same links)."
    )
    p.add_argument("--replan", action="store_true", help="Only recompute --json from its .runs.json.")
    p.add_argument("--rates", default="100mbit,1gbit", help="Inter-node link rates, comma-separated.")
    p.add_argument("--methods", default=",".join(METHODS), help="Methods, comma-separated.")
    p.add_argument("--model", default="wide-mlp", choices=list(MODELS))
    p.add_argument("--epochs", type=int, default=640, help="At 480 a rank: one step an epoch.")
    p.add_argument("--batch-size", type=int, default=480, help="Per rank; 0: the model's recipe.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpus",
        default="",
        help="Cores the ranks run on, comma-separated (default: every core). 0: the three ranks share "
        "one core, each a third of it, instead of two cores where one rank may get one to itself",
    )
    p.add_argument(
        "--cpus-per-node",
        default="auto",
        help="`ringtree emulate --cpus-per-node`: auto caps every node at an equal share of the host's "
        "cores, as separate machines would have; shared lets the scheduler share them freely",
    )
    p.add_argument("--repeats", type=int, default=3, help="Rounds; each row is the median over them.")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.json.read_text())["rows"]))
        return
    if args.replan:
        if not args.json.with_suffix(".runs.json").is_file():
            refuse(f"--replan: {args.json.with_suffix('.runs.json')} does not exist; measure first")
        replan(args.json, json.loads(args.json.with_suffix(".runs.json").read_text()))
        return
    if not args.json.parent.is_dir():
        refuse(f"--json: the folder {args.json.parent} does not exist")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        refuse(f"--methods: unknown {unknown[0]!r}; known: {', '.join(METHODS)}")
    if args.cpus:  # the processes started inherit the affinity
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except (ValueError, OSError):
            last = (os.cpu_count() or 1) - 1
            refuse(f"--cpus {args.cpus!r}: give this machine's cores, comma-separated (0 to {last})")
    try:  # emulate's own reading of it, on the cores this process may use (after --cpus)
        cpu.parse(args.cpus_per_node, NODES)
    except ValueError as e:
        refuse(str(e))
    env = environment() | {"cpus_per_node": args.cpus_per_node}
    raw: dict[str, Any] = {"environment": env, "links": {}, "calibrations": {}, "runs": []}
    if args.append:  # more rounds on the same links: the rows become medians over all of them
        if not args.json.with_suffix(".runs.json").is_file():
            refuse(f"--append: {args.json.with_suffix('.runs.json')} does not exist; run once without it")
        raw = json.loads(args.json.with_suffix(".runs.json").read_text())
        if raw["environment"].get("cpus_per_node", "shared") != args.cpus_per_node:
            refuse(
                f"--append: {args.json.with_suffix('.runs.json')} was measured with --cpus-per-node "
                f"{raw['environment'].get('cpus_per_node', 'shared')}; give the same"
            )
    first = 1 + max((int(r.get("round", 0)) for r in raw["runs"]), default=-1)
    with tempfile.TemporaryDirectory(prefix="ringtree-slow-network-") as tmp:
        for k in range(first, first + args.repeats):
            for rate in args.rates.split(","):
                if rate not in raw["calibrations"]:
                    raw["calibrations"][rate] = calibrate(rate, Path(tmp), args.cpus_per_node)
                for method in methods:
                    run = measure(args, method, rate, Path(tmp), f"-r{k}", raw["links"]) | {"round": k}
                    print(json.dumps(run), flush=True)
                    raw["runs"].append(run)
            raw["environment"] = environment() | {"cpus_per_node": args.cpus_per_node}
            write_json(args.json.with_suffix(".runs.json"), raw)  # kept if the plans fail
            replan(args.json, raw)


def replan(path: Path, raw: dict[str, Any]) -> None:
    """The median row of each (link, method) with the planner beside it, written to `path`; links
    not calibrated yet (a record of an earlier version) are, and kept in the runs' record."""
    runs: list[dict[str, Any]] = raw["runs"]
    calibrations = raw.setdefault("calibrations", {})
    missing = sorted({r["inter_bw"] for r in runs} - set(calibrations))
    if missing:
        with tempfile.TemporaryDirectory(prefix="ringtree-slow-network-") as tmp:
            for rate in missing:
                calibrations[rate] = calibrate(
                    rate, Path(tmp), raw["environment"].get("cpus_per_node", "shared")
                )
        write_json(path.with_suffix(".runs.json"), raw)
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        r.setdefault("algorithm", "ring")  # the trainer's default, before the runs recorded it
        grouped.setdefault((r["inter_bw"], r["method"]), []).append(r)
    rows = summarise([median_row(v) for v in grouped.values()], calibrations)
    record = {"environment": raw["environment"], "links": raw["links"], "rows": rows}
    record["calibrated_links"] = {
        rate: {k: c["fit"][k] for k in ("inter_alpha_s", "inter_bandwidth_Bps", "rms_rel_error")}
        for rate, c in calibrations.items()
    }
    write_json(path, record)


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
