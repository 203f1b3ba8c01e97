"""Two-level calibration from bench rows, NCCL-model calibration from nccl-tests logs, and sim using both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ringtree.cli import app
from ringtree.sim import Cluster, Link, allreduce_time, estimate, make_cluster
from ringtree.sim.network import nccl_fit, nccl_model
from ringtree.sim.network.calibrate import fit
from ringtree.sim.network.nccl_tests import parse

runner = CliRunner()
DATA = Path(__file__).parent / "data" / "nccl-tests"
INTRA, INTER, GAMMA = Link("intra", 20e-6, 5e9), Link("inter", 150e-6, 0.25e9), 1e-10


def bench_rows(shapes: tuple[tuple[int, int], ...] = ((1, 4), (2, 2))) -> list[dict[str, Any]]:
    """Rows `ringtree bench --json` would write on a two-level machine that follows the model."""
    rows: list[dict[str, Any]] = []
    for nodes, per_node in shapes:
        cluster = Cluster(nodes, per_node, INTRA, INTER, GAMMA)
        for algorithm in ("ring", "hierarchical"):
            for k in range(12, 25, 3):
                t = estimate(algorithm, cluster, 1 << k)
                rows.append(
                    {"collective": "all_reduce", "algorithm": algorithm, "bytes": 1 << k,
                     "count": 1 << (k - 2), "dtype": "float32", "op": "sum",
                     "world_size": nodes * per_node, "nodes": nodes,
                     "ranks_per_node": per_node, "time_us": t * 1e6, "wrong": 0}
                )  # fmt: skip
    return rows


def test_two_level_fit_recovers_both_links() -> None:
    fitted = fit(bench_rows())
    assert fitted.alpha_s == pytest.approx(INTRA.alpha_s, rel=1e-3)
    assert fitted.link.bandwidth_Bps == pytest.approx(INTRA.bandwidth_Bps, rel=1e-3)
    assert fitted.inter_link is not None
    assert fitted.inter_link.alpha_s == pytest.approx(INTER.alpha_s, rel=1e-3)
    assert fitted.inter_link.bandwidth_Bps == pytest.approx(INTER.bandwidth_Bps, rel=1e-3)
    assert fitted.gamma_s_per_byte == pytest.approx(GAMMA, rel=1e-2)
    assert set(fitted.levels) == {"intra", "inter"} and fitted.levels["inter"].rms_rel_error < 1e-6


def test_rows_without_node_keys_are_one_level() -> None:
    rows = [
        {k: v for k, v in r.items() if k not in ("nodes", "ranks_per_node")} for r in bench_rows(((1, 4),))
    ]
    fitted = fit(rows)
    assert fitted.inter_link is None and set(fitted.levels) == {"intra"}
    assert fitted.alpha_s == pytest.approx(INTRA.alpha_s, rel=1e-3)


def test_calibrate_writes_levels_and_sim_uses_both(tmp_path: Path) -> None:
    bench, machine, out = tmp_path / "bench.json", tmp_path / "machine.json", tmp_path / "sim.json"
    bench.write_text(json.dumps(bench_rows()))
    result = runner.invoke(app, ["calibrate", str(bench), "--out", str(machine)])
    assert result.exit_code == 0, result.output
    assert "inter: rms error" in result.output
    data = json.loads(machine.read_text())
    assert data["levels"]["inter"]["rows"] == 10 and data["inter_bandwidth_Bps"] == pytest.approx(
        0.25e9, rel=1e-3
    )
    args = ["sim", "--calibration", str(machine), "--nodes", "4", "--gpus-per-node", "2", "--bytes", "4M"]
    assert runner.invoke(app, [*args, "--json", str(out)]).exit_code == 0
    (row,) = json.loads(out.read_text())
    truth = allreduce_time("ring", Cluster(4, 2, INTRA, INTER, GAMMA), 4 << 20)
    assert row["time_s"] == pytest.approx(truth.seconds, rel=1e-3)


def nccl_rows(*names: str) -> list[dict[str, Any]]:
    return [m for n in names for run in parse(DATA / n) for m in run.measurements()]


def test_nccl_fit_recovers_the_synthetic_machines_corrections() -> None:
    section = nccl_fit.fit(nccl_rows("a100-1x8-old.log", "a100-2x8-mpirun.log"))
    c = section["corrections"]
    # make_synthetic.py: latency x1.8 / x1.3, transfer x1.04 / x1.10, +-2% wobble
    assert c["latency_intra"] == pytest.approx(1.8, rel=0.05)
    assert c["latency_inter"] == pytest.approx(1.3, rel=0.05)
    assert c["transfer_intra"] == pytest.approx(1.04, rel=0.03)
    assert c["transfer_inter"] == pytest.approx(1.10, rel=0.03)
    assert section["levels"]["intra"]["rms_rel_error"] < 0.03


def test_nccl_calibration_predicts_a_held_out_gpu_count(tmp_path: Path) -> None:
    machine = tmp_path / "a100.json"
    logs = [str(DATA / "a100-1x8-old.log"), str(DATA / "a100-2x8-mpirun.log")]
    result = runner.invoke(app, ["calibrate", *logs, "--out", str(machine)])
    assert result.exit_code == 0, result.output
    cluster = make_cluster(4, 8, calibration=machine)
    held_out = nccl_rows("a100-4x8.log")
    predicted = np.array([allreduce_time("native", cluster, r["bytes"]).seconds * 1e6 for r in held_out])
    measured = np.array([r["time_us"] for r in held_out])
    rel = predicted / measured - 1
    assert float(np.sqrt(np.mean(rel**2))) < 0.05


def test_sim_shows_nccls_pick_and_crossovers(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = ["sim", "--intra", "nvlink-a100", "--gpus-per-node", "8", "--algorithm", "native", "--bytes", "1G"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "ring/LL128 from 2.0M" in result.output and "ring/Simple from 23.2M" in result.output
    (row,) = json.loads(out.read_text())
    assert row["nccl_choice"] == "ring/Simple" and row["method"] == "nccl-model"


def test_mixed_bench_rows_and_nccl_logs_in_one_call(tmp_path: Path) -> None:
    bench, machine = tmp_path / "bench.json", tmp_path / "m.json"
    bench.write_text(json.dumps(bench_rows(((1, 4),))))
    result = runner.invoke(
        app, ["calibrate", str(bench), str(DATA / "a100-1x8-step.log"), "--out", str(machine)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(machine.read_text())
    assert data["alpha_s"] == pytest.approx(INTRA.alpha_s, rel=1e-3)
    assert data["nccl"]["fitted"] == ["latency_intra", "transfer_intra"]
    cluster = make_cluster(1, 4, calibration=machine)
    ring = allreduce_time("ring", cluster, 1 << 20, "closed-form")  # ringtree's ring: the bench-fitted link
    assert ring.seconds == pytest.approx(
        allreduce_time("ring", Cluster(1, 4, INTRA, INTRA, GAMMA), 1 << 20).seconds
    )
    read = allreduce_time("ring", cluster, 1 << 20)  # rows measured at 1 x 4: read off them
    assert read.method == "measured" and read.seconds == pytest.approx(ring.seconds, rel=0.15)
    assert allreduce_time("native", cluster, 1 << 20).method == "nccl-model"  # native: NCCL's model
    json.loads(machine.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_published_a100_log_fit_and_a_two_node_prediction() -> None:
    rows = nccl_rows("a100-1x8-galvatron.log")
    section = nccl_fit.fit(rows)
    assert section["levels"]["intra"]["rms_rel_error"] < 0.12
    table = section["table"]
    uncorrected = np.array([r["nccl_model_us"] / r["measured_us"] - 1 for r in table])
    assert float(np.sqrt(np.mean(uncorrected**2))) > 0.3  # what the calibration buys on this log
    tuning = nccl_fit.tuning(section)
    seconds, choice = nccl_model.allreduce_seconds(tuning, 16, 2, 1 << 30)
    # OCI BM.GPU.B4.8, 2 x 8 A100, 1 GiB: 10,785 us (docs/results/collective-model-accuracy.md, source d)
    assert choice.label == "ring/Simple" and seconds * 1e6 == pytest.approx(10785, rel=0.05)
