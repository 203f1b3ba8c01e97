"""`ringtree sim`, `plan` and `calibrate` through the command line, and calibration on known data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli import app
from ringtree.sim import Cluster, Link, estimate
from ringtree.sim.network.calibrate import fit

runner = CliRunner()
TRUE = {"alpha_s": 30e-6, "bandwidth_Bps": 2e9, "gamma": 2e-10}


def synthetic_rows(p: int = 4) -> list[dict[str, object]]:
    """What `ringtree bench --json` would write on a machine that follows the model exactly."""
    link = Link("true", TRUE["alpha_s"], TRUE["bandwidth_Bps"])
    machine = Cluster(1, p, link, link, TRUE["gamma"])
    rows: list[dict[str, object]] = []
    for algorithm in ("ring", "double_tree"):
        for k in range(16, 27, 2):
            t = estimate(algorithm, machine, 1 << k)
            rows.append(
                {"collective": "all_reduce", "algorithm": algorithm, "bytes": 1 << k, "count": 1 << (k - 2),
                 "dtype": "float32", "op": "sum", "world_size": p, "time_us": t * 1e6,
                 "algbw_gbps": 0.0, "busbw_gbps": 0.0, "wrong": 0}
            )  # fmt: skip
    return rows


def test_fit_recovers_known_alpha_beta_gamma() -> None:
    fitted = fit(synthetic_rows())
    assert fitted.alpha_s == pytest.approx(TRUE["alpha_s"], rel=0.01)
    assert fitted.link.bandwidth_Bps == pytest.approx(TRUE["bandwidth_Bps"], rel=0.01)
    assert fitted.gamma_s_per_byte == pytest.approx(TRUE["gamma"], rel=0.05)
    assert fitted.max_rel_error < 0.01


def test_calibrate_then_predict_with_it(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(synthetic_rows()))
    machine = tmp_path / "machine.json"
    result = runner.invoke(app, ["calibrate", str(bench), "--out", str(machine)])
    assert result.exit_code == 0, result.output
    assert json.loads(machine.read_text())["alpha_s"] == pytest.approx(30e-6, rel=0.01)
    out = tmp_path / "sim.json"
    args = [
        "sim",
        "--gpus-per-node",
        "4",
        "--calibration",
        str(machine),
        "--bytes",
        "16M",
        "--json",
        str(out),
    ]
    assert runner.invoke(app, args).exit_code == 0
    (row,) = json.loads(out.read_text())
    link = Link("true", TRUE["alpha_s"], TRUE["bandwidth_Bps"])
    assert row["time_s"] == pytest.approx(
        estimate("ring", Cluster(1, 4, link, link, TRUE["gamma"]), 16 << 20), rel=0.02
    )


def test_sim_json_rows_and_sweep_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sweep.png"
    base = ["sim", "--nodes", "3", "--gpus-per-node", "8", "--intra", "pcie-gen3", "--inter", "eth-10g"]
    result = runner.invoke(app, [*base, "--algorithm", "all", "--bytes", "64M", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert {r["algorithm"] for r in rows} >= {"ring", "double_tree", "hierarchical", "bfb"}
    assert all({"algorithm", "ranks", "bytes", "time_s", "method"} <= set(r) for r in rows)
    assert all(r["ranks"] == 24 and r["bytes"] == 64 << 20 and r["method"] == "replay" for r in rows)
    args = [*base, "--algorithm", "ring,double_tree", "--sweep", "nodes", "--nodes", "64", "--bytes", "8"]
    result = runner.invoke(app, [*args, "--plot", str(png), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 1000
    assert sorted({r["ranks"] for r in json.loads(out.read_text())}) == [8, 16, 32, 64, 128, 256, 512]


def test_sim_errors_name_the_fix() -> None:
    result = runner.invoke(app, ["sim", "--nodes", "2", "--intra", "pcie-gen3"])
    assert result.exit_code == 2 and "--calibration" in result.output
    result = runner.invoke(app, ["sim", "--intra", "pcie-gen3", "--algorithm", "hypercube"])
    assert result.exit_code == 2 and "hypercube" in result.output


def test_plan_reference_case_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    args = ["plan", "--model", "vit-base", "--grad-dtype", "fp16", "--compute-time", "0.4", "--nodes", "3",
            "--gpus-per-node", "8", "--intra", "pcie-gen3", "--inter", "eth-10g", "--algorithm", "ring",
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["algorithm"] == "ring" and plan["recommended_algorithm"] == "hierarchical"
    assert 0.26 <= plan["dp_allreduce_s"] <= 0.275
    assert plan["step_s"] == pytest.approx(0.675, abs=0.01)
    assert plan["breakdown"]["compute_s"] == 0.4
    assert plan["speedup_vs_one_node"] == pytest.approx(1.86, abs=0.03)
    assert plan["scaling_efficiency"] == pytest.approx(plan["speedup_vs_one_node"] / 3)
    assert png.stat().st_size > 1000


def test_plan_counts_a_real_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny_model.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Linear(100, 10)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    args = ["plan", "--module", "tiny_model:make", "--compute-time", "0.01", "--intra", "nvlink-a100",
            "--json", str(out)]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    assert json.loads(out.read_text())["config"]["params"] == 1010
    result = runner.invoke(app, ["plan", "--model", "vit-base", "--params", "1M", "--compute-time", "1"])
    assert result.exit_code == 2 and "exactly one" in result.output
