"""`ringtree plan --tp`: tensor-parallel all-reduces priced on the TP group's link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim import make_cluster
from ringtree.sim.network.closed_form import estimate
from ringtree.sim.training.plan import StepConfig, predict_step
from ringtree.sim.training.tensor_parallel import TPShape, dp_cluster, predict_tp_step, tp_cluster

CLUSTER = make_cluster(4, 8, "nvlink-a100", "eth-10g", None, 1)
CONFIG = StepConfig(1_500_000_000, 1.0, "fp16", None, False, 25.0, 1, 8)
SHAPE = TPShape(48, 1600, 1024, 8, 2)


def test_tp_step_adds_tp_all_reduces_and_a_smaller_dp_all_reduce() -> None:
    row = predict_tp_step(CONFIG, SHAPE, CLUSTER, 8)
    one = estimate("ring", tp_cluster(CLUSTER, 8), SHAPE.activation_bytes, 2)
    assert row.tp_link == "intra" and row.tp_comm_s == pytest.approx(4 * 48 * one)
    dp = dp_cluster(CLUSTER, 8)
    assert (dp.nodes, dp.gpus_per_node) == (4, 1)  # one TP group per node: DP runs across nodes
    params = CONFIG.params // 8
    want = predict_step(StepConfig(params, 1.0 / 8 + row.tp_comm_s, "fp16", None, False, 25.0, 1, 8), dp)
    assert row.step_s == pytest.approx(want.step_s)
    assert row.step_s == pytest.approx(sum(row.breakdown.values()))


def test_tp_across_a_slow_network_ruins_throughput() -> None:
    inside = predict_tp_step(CONFIG, SHAPE, CLUSTER, 4)
    across = predict_tp_step(CONFIG, SHAPE, CLUSTER, 4, spread=True)
    assert across.tp_link == "inter" and inside.tp_link == "intra"
    assert across.tp_comm_s > 20 * inside.tp_comm_s
    # Inside a node the four DP groups share the one NIC (over 4 s of DP all-reduce); across, 6 s of TP.
    assert across.samples_per_s < 0.75 * inside.samples_per_s


def test_plan_cli_with_tp(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt2-xl", "--grad-dtype", "fp16", "--compute-time", "1", "--nodes", "8"]
    args += ["--intra", "nvlink-a100", "--inter", "eth-100g", "--tp", "8", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    tp = json.loads(out.read_text())["tensor_parallel"]
    assert tp["inside_node"]["tp"] == 8 and tp["across_nodes"]["tp_link"] == "inter"
    assert tp["across_nodes"]["step_s"] > tp["inside_node"]["step_s"]
    bad = CliRunner().invoke(
        app,
        [
            "plan",
            "--params",
            "1B",
            "--compute-time",
            "1",
            "--intra",
            "pcie-gen3",
            "--inter",
            "eth-10g",
            "--tp",
            "2",
        ],
    )
    assert bad.exit_code == 2 and "--shape" in bad.output
