"""`ringtree show zero1|zero2|zero3 --ranks P`: the holdings per step as data, the table, the picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli import app
from ringtree.show.zero import SHARD, WHOLE, cell, ddp_units, zero_steps
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.plan import StepConfig, predict_step


def test_zero3_gathers_each_layer_for_its_forward_and_backward_only() -> None:
    steps = zero_steps(3, layers=4)
    assert [s.action for s in steps][:2] == ["start of the step", "forward L0"]
    assert (
        steps[1].holds["params"] == (WHOLE, SHARD, SHARD, SHARD) and steps[1].comm == "all-gather params L0"
    )
    assert steps[5].action == "backward L3" and steps[5].holds["params"] == (SHARD, SHARD, SHARD, WHOLE)
    assert steps[5].comm == "all-gather params L3, then reduce-scatter grads L3"
    assert steps[-1].holds == {k: (SHARD,) * 4 for k in ("params", "grads", "optimizer")}
    assert steps[-1].units(4) / ddp_units(4) == 0.25  # everything in quarters at 4 ranks
    assert "all-gather params" not in [s.comm for s in steps]  # zero 3 gathers lazily, layer by layer


def test_zero1_and_zero2_keep_whole_parameters_and_gather_after_the_step() -> None:
    one, two = zero_steps(1), zero_steps(2)
    assert all(h == WHOLE for s in one + two for h in s.holds["params"])
    assert one[-1].holds["grads"] == (WHOLE,) * 4 and two[-1].holds["grads"] == (SHARD,) * 4
    assert one[-1].comm == two[-1].comm == "all-gather params"
    assert "all-reduce grads, step with block r" in [s.comm for s in one]
    assert cell(two[-1].holds, 2) == "P WWWW G 2222 O 2222"


def test_command_prints_every_rank_and_writes_json_and_png(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        app,
        [
            "show",
            "zero3",
            "--ranks",
            "2",
            "--json",
            str(tmp_path / "z.json"),
            "--png",
            str(tmp_path / "p.png"),
        ],
        env={"COLUMNS": "200"},
    )
    assert out.exit_code == 0, out.output
    assert "P W000 G .... O 0000" in out.output and "P W111 G .... O 1111" in out.output  # forward L0
    assert "P 1111 G 1111 O 1111" in out.output  # rank 1 at the end: its quarter of everything
    data = json.loads((tmp_path / "z.json").read_text())
    assert data["zero"] == 3 and data["ranks"] == 2 and len(data["steps"]) == len(zero_steps(3))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_options_of_other_shows_are_refused() -> None:
    out = CliRunner().invoke(app, ["show", "zero2", "--stages", "4"])
    assert out.exit_code == 2 and "--stages does not apply to a ZeRO step" in out.output


def test_plan_from_run_carries_the_runs_zero(tmp_path: Path) -> None:
    summary = {"step_time_s": 0.42, "exposed_comm_time_s": 0.02, "parameters": 86_000_000, "accumulate": 1,
               "batch_size": 32, "overlap": False, "bucket_mb": 25.0, "algorithm": "ring", "mode": "ddp",
               "world_size": 8, "nodes": 1, "zero": 3}  # fmt: skip
    run, out = tmp_path / "run.json", tmp_path / "plan.json"
    run.write_text(json.dumps(summary))
    args = ["plan", "--from-run", str(run), "--nodes", "2", "--gpus-per-node", "8", "--intra", "pcie-gen3",
            "--inter", "eth-10g", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["zero"] == 3
    del summary["zero"]  # a run from before --zero: DDP
    run.write_text(json.dumps(summary))
    assert CliRunner().invoke(app, args).exit_code == 0 and json.loads(out.read_text())["zero"] == 0


def test_plan_from_run_prices_zero_3s_gathers_not_ddps_all_reduce() -> None:
    """A ZeRO-3 run moves 1.5 x DDP's bytes: the gradient reduce-scatter (half an all-reduce) and
    each bucket's parameters gathered twice (forward and backward, half an all-reduce each); with
    nothing to hide behind, its step is longer than DDP's; ZeRO-1 moves DDP's bytes, split in two."""
    slow = Cluster(2, 4, Link("nv", 0.0, 1e11), Link("net", 0.0, 1e9))
    ddp, z1, z3 = (StepConfig(86_000_000, 1e-9, "fp16", zero=z) for z in (0, 1, 3))
    rows = [predict_step(c, slow, "ring") for c in (ddp, z1, z3)]
    assert rows[2].zero == 3 and rows[2].dp_allreduce_s == pytest.approx(rows[0].dp_allreduce_s / 2)
    assert rows[2].exposed_zero_gather_s == pytest.approx(rows[0].dp_allreduce_s, rel=1e-3)
    # the reduce-scatter may overlap only the backward's gathers: the step exceeds DDP's
    assert rows[0].step_s * 1.05 < rows[2].step_s <= 1.5 * rows[0].step_s * 1.001
    assert rows[1].step_s == pytest.approx(rows[0].step_s, rel=1e-3)
