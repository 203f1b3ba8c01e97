"""`ringtree train --profile DIR` writes a torch.profiler trace per rank, and `ringtree trace DIR`
reads it: a 4-rank gloo run whose rank 2 sleeps before each step's all-reduce in its first steps
names rank 2 and about the time it costs in those steps, and no rank in the steps after."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app

SLEEP_S = 0.03
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10  # trace_models.slow_rank_mlp


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank run, steps 1-8 profiled; rank 2 sleeps in steps 0-4 only."""
    folder = tmp_path_factory.mktemp("profiled")
    mp = pytest.MonkeyPatch()
    mp.setenv("RINGTREE_TEST_SLOW_RANK", f"2:{SLEEP_S}:5")
    args = ["train", "--nproc", "4", "--model", "trace_models:slow_rank_mlp", "--epochs", "1"]
    args += ["--profile", str(folder / "traces"), "--profile-steps", "1:8", "--no-progress"]
    try:
        result = CliRunner().invoke(app, [*args, "--json", str(folder / "summary.json")])
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    return folder


def _trace(folder: Path, steps: str) -> dict[str, Any]:
    out = folder / f"report-{steps.replace(':', '-')}.json"
    result = CliRunner().invoke(app, ["trace", str(folder / "traces"), "--steps", steps, "--json", str(out)])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_one_trace_per_rank_with_its_steps(profiled: Path) -> None:
    names = sorted(p.name for p in (profiled / "traces").iterdir())
    assert names == [f"rank{r}.json.gz" for r in range(4)]
    report = _trace(profiled, "1:8")
    assert report["device"] == "cpu" and report["world_size"] == 4 and report["steps"] == list(range(1, 9))
    (row,) = report["collectives"]
    assert row["op"] == "all_reduce" and row["matched_ranks"] == 4 and row["count"] == 8
    assert row["bytes"] == 4 * PARAMETERS and row["dtype"] == "float32"  # one bucket: every gradient


def test_the_slow_rank_is_named_with_what_it_costs(profiled: Path) -> None:
    report = _trace(profiled, "1:4")
    (straggler,) = report["stragglers"]
    assert straggler["rank"] == 2 and straggler["steps"] == [1, 2, 3, 4]
    assert 0.4 * SLEEP_S < straggler["late_s_per_step"] < 1.5 * SLEEP_S
    assert any(re.match(r"rank 2 is the straggler", line) for line in report["verdict"])
    slow = next(r for r in report["ranks"] if r["rank"] == 2)
    assert slow["idle_host_wait_s"] > 4 * 0.5 * SLEEP_S  # the sleep: the thread runs no operator


def test_no_slow_rank_no_straggler(profiled: Path) -> None:
    report = _trace(profiled, "6:8")
    assert report["stragglers"] == []
    assert "no straggler" in " ".join(report["verdict"])


def test_profile_options_are_checked_before_any_worker(tmp_path: Path) -> None:
    for args, said in (
        (["--profile-steps", "2:5"], "--profile-steps needs --profile"),
        (["--profile", str(tmp_path / "p"), "--profile-steps", "5:2"], "FIRST:LAST"),
    ):
        result = CliRunner().invoke(app, ["train", "--nproc", "2", *args], env={"COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        assert said in result.output


def test_plan_from_the_trace_reproduces_the_measured_step(profiled: Path) -> None:
    """The traced run's own layout gives its measured step back (within 10%); more nodes on a
    slower network predict a longer all-reduce, with the run's waiting kept."""
    from ringtree.json_keys import OUTPUTS

    links = ["--intra", "pcie-gen3", "--inter", "eth-10g"]
    own, more = profiled / "own.json", profiled / "more.json"
    traces = str(profiled / "traces")
    for args, out in (([], own), (["--nodes", "4", "--gpus-per-node", "4"], more)):
        result = CliRunner().invoke(app, ["plan", "--from-trace", traces, *links, *args, "--json", str(out)])
        assert result.exit_code == 0, result.output
    mine, asked = json.loads(own.read_text()), json.loads(more.read_text())
    summary = json.loads((profiled / "summary.json").read_text())
    assert mine["predicted_run_step_s"] == pytest.approx(mine["measured_run_step_s"], rel=0.10)
    assert mine["measured_run_step_s"] == pytest.approx(summary["step_time_s"], rel=0.5)  # the same run
    assert mine["traced_grad_bytes"] == 4 * PARAMETERS
    assert asked["ranks"] == 16 and asked["dp_allreduce_s"] > mine["dp_allreduce_s"]
    assert set(asked) - set(OUTPUTS["plan"].keys) <= set(OUTPUTS["plan-from-trace"].keys)
