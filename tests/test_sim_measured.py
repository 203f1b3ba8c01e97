"""The planner reads all-reduce times off a calibration's measured rows: at the planned size, per
algorithm, per node shape; and the fit behind it on rows of one rank per node."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ringtree.cli import app
from ringtree.sim import Cluster, Link, estimate, make_cluster
from ringtree.sim.network.calibrate import fit, without_gamma
from ringtree.sim.network.measured import nondecreasing
from ringtree.sim.training.explain import explain
from ringtree.sim.training.plan import StepConfig, predict_step

runner = CliRunner()
NET = Link("net", 200e-6, 12.5e6)  # 100 Mbit/s
SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def row(algorithm: str, nodes: int, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"collective": "all_reduce", "algorithm": algorithm, "bytes": nbytes, "count": nbytes // 4,
            "dtype": "float32", "op": "sum", "world_size": nodes, "nodes": nodes, "ranks_per_node": 1,
            "time_us": seconds * 1e6, "wrong": 0}  # fmt: skip


def tcp_like(algorithm: str, nodes: int, slow: float = 1.0) -> list[dict[str, Any]]:
    """Rows that no alpha-beta form follows: the link ramps up with size (as TCP does)."""
    out = []
    for n in SIZES:
        ramp = 1.0 + 2.0 / math.sqrt(n / (16 << 10))  # 3x slower than the link at 16 kB, ~1.1x at 4 MB
        out.append(
            row(algorithm, nodes, n, slow * ramp * estimate("ring", Cluster(nodes, 1, NET, NET, 0.0), n))
        )
    return out


def calibrated(tmp_path: Path, rows: list[dict[str, Any]], nodes: int) -> Cluster:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(fit(rows).as_dict()))
    return make_cluster(nodes, 1, calibration=path)


def planned_allreduce(cluster: Cluster, nbytes: int, algorithm: str) -> float:
    config = StepConfig(params=nbytes // 4, compute_time_s=0.01)
    return predict_step(config, cluster, algorithm).dp_allreduce_s


def between(rows: list[dict[str, Any]], nbytes: int) -> float:
    """Log-log interpolation of the rows' times at nbytes."""
    (a, ta), (b, tb) = [
        (r["bytes"], r["time_us"] * 1e-6) for r in rows if r["bytes"] in (64 << 10, 256 << 10)
    ]
    w = math.log(nbytes / a) / math.log(b / a)
    return math.exp((1 - w) * math.log(ta) + w * math.log(tb))


def test_rows_of_one_rank_per_node_fit_the_network() -> None:
    fitted = fit(tcp_like("ring", 2))
    assert fitted.inter_link is not None and fitted.inter_link == Link(
        "calibrated-inter", fitted.alpha_s, fitted.link.bandwidth_Bps
    )
    assert fitted.gamma_s_per_byte == 0.0  # cannot be told from beta with one rank per node
    assert {r["bytes"] for r in fitted.measured} == set(SIZES) and set(fitted.algorithms) == {"ring"}


def test_gamma_is_dropped_only_when_indistinguishable() -> None:
    import numpy as np

    assert without_gamma(np.array([[1.0, 4.0, 2.0], [1.0, 8.0, 4.0], [1.0, 16.0, 8.0]]))
    assert not without_gamma(np.array([[1.0, 4.0, 2.0], [1.0, 8.0, 1.0], [1.0, 16.0, 8.0]]))


def test_plan_reads_the_rows_at_the_planned_size(tmp_path: Path) -> None:
    rows = tcp_like("ring", 2)
    cluster = calibrated(tmp_path, rows, 2)
    n = 104_488  # the mlp's gradients, between the 64 kB and 256 kB rows
    assert planned_allreduce(cluster, n, "ring") == pytest.approx(between(rows, n), rel=1e-9)
    on_fit = estimate("ring", cluster, n)  # what the fit alone says: far from the rows here
    assert abs(on_fit / between(rows, n) - 1) > 0.1
    # outside the rows: the nearest row scaled by the fit, continuous at the edge
    top = rows[-1]["time_us"] * 1e-6
    assert planned_allreduce(cluster, 4 << 20, "ring") == pytest.approx(top, rel=1e-9)
    big = planned_allreduce(cluster, 16 << 20, "ring")
    assert big == pytest.approx(
        top * estimate("ring", cluster, 16 << 20) / estimate("ring", cluster, 4 << 20)
    )


def test_each_algorithm_from_its_own_rows(tmp_path: Path) -> None:
    rows = tcp_like("ring", 2, slow=2.0) + tcp_like("native", 2)
    cluster = calibrated(tmp_path, rows, 2)
    n = 104_488
    native = planned_allreduce(cluster, n, "native")
    ring = planned_allreduce(cluster, n, "ring")
    assert native == pytest.approx(between([r for r in rows if r["algorithm"] == "native"], n), rel=1e-9)
    assert ring == pytest.approx(2 * native, rel=1e-9)
    # an algorithm without rows of its own: the closed form on the overall fit, and the plan says so
    assert planned_allreduce(cluster, n, "double_tree") == pytest.approx(estimate("double_tree", cluster, n))
    lines = explain(StepConfig(params=n // 4, compute_time_s=0.01), cluster, "double_tree")["lines"]
    assert any("no double_tree rows" in line for line in lines)


def test_node_shape_prefers_own_rows_else_scales_by_steps(tmp_path: Path) -> None:
    two, three = tcp_like("ring", 2), tcp_like("ring", 3, slow=1.5)
    n = 104_488
    both = calibrated(tmp_path, two + three, 3)
    assert planned_allreduce(both, n, "ring") == pytest.approx(between(three, n), rel=1e-9)
    only_two = calibrated(tmp_path, two, 3)
    steps = estimate("ring", only_two, n) / estimate("ring", only_two.with_nodes(2), n)
    assert steps > 1.2  # a 3-rank ring has 4 steps of S/3 against 2 of S/2
    assert planned_allreduce(only_two, n, "ring") == pytest.approx(between(two, n) * steps, rel=1e-9)


def test_error_bar_is_the_residual_at_the_planned_size(tmp_path: Path) -> None:
    rows = tcp_like("ring", 2)
    cluster = calibrated(tmp_path, rows, 2)
    fitted = fit(rows)
    at = {r["bytes"]: abs(r["fit_rel_error"]) for r in fitted.measured}
    n = 64 << 10  # on a row: exactly its residual
    why = explain(StepConfig(params=n // 4, compute_time_s=0.01), cluster, "ring")
    assert why["error_bar_rel"] == pytest.approx(at[n])
    assert any("interpolated" in line or "rows on 2 x 1" in line for line in why["lines"])


def test_plan_cli_native_from_native_rows(tmp_path: Path) -> None:
    bench, cal, out = tmp_path / "bench.json", tmp_path / "cal.json", tmp_path / "plan.json"
    rows = tcp_like("ring", 2, slow=2.0) + tcp_like("native", 2)
    bench.write_text(json.dumps(rows))
    assert runner.invoke(app, ["calibrate", str(bench), "--out", str(cal)]).exit_code == 0
    args = ["plan", "--params", "26122", "--compute-time", "0.003", "--nodes", "2", "--gpus-per-node", "1",
            "--calibration", str(cal), "--algorithm", "native", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    native_rows = [r for r in rows if r["algorithm"] == "native"]
    assert plan["algorithm"] == "native" and plan["dp_allreduce_s"] == pytest.approx(
        between(native_rows, 104_488), rel=1e-6
    )
    assert {"step_s", "speedup_vs_one_node"} <= set(plan) and "step_time_s" not in plan


def test_nondecreasing_pools_violators() -> None:
    assert nondecreasing([1.0, 5.0, 2.0, 3.0, 4.0, 1.0, 9.0]) == (1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 9.0)
    assert nondecreasing([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)


def test_a_trained_runs_prediction_carries_its_zero_stage(tmp_path: Path) -> None:
    """`ringtree train --calibration` predicts its own step as `plan --from-run` would: a ZeRO-3
    run's per-bucket gathers are priced, not a DDP all-reduce."""
    from ringtree.train.planning import predicted_step_time

    rows = [
        row("ring", n, b, estimate("ring", Cluster(n, 1, NET, NET, 0.0), b)) for n in (2, 4) for b in SIZES
    ]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(fit(rows).as_dict()))
    summary = {"algorithm": "ring", "mode": "ddp", "pp": 1, "parameters": 1_000_000, "step_time_s": 0.5,
               "exposed_comm_time_s": 0.1, "accumulate": 1, "compression": None, "overlap": True,
               "bucket_mb": 1.0, "batch_size": 8, "nodes": 4, "world_size": 4}  # fmt: skip
    cluster = make_cluster(4, 1, calibration=path)
    for zero in (0, 3):
        run = {**summary, "zero": zero}
        expected = predict_step(StepConfig.from_summary(run), cluster, "ring").step_s
        assert predicted_step_time(run, path) == pytest.approx(expected)
    assert predicted_step_time({**summary, "zero": 3}, path) != predicted_step_time(summary, path)
