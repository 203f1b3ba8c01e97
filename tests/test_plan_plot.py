"""`ringtree plan --plot`: the picture's stages and parts are the plan's JSON, stage by stage."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ringtree import plan_plot
from ringtree.cli.app import app
from ringtree.plan_plot import Segment, draw_plan, memory_segments, step_segments
from ringtree.sim.network.clusters import get
from ringtree.sim.training.layout import Training
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.transformer import MODELS

runner = CliRunner()
PLAN = ["plan", "--model", "llama3-8b", "--global-batch", "64", "--nodes", "2", "--cluster", "dgx-h100"]


def _sums(segments: list[Segment]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in segments:
        out[s.stage][s.part] += s.size
    return out


@pytest.mark.parametrize(
    "layout",
    [
        Training(64, 1, tp=4, pp=2, cp=2, sequence_parallel=True, zero=1, recompute="selective"),
        Training(64, 2, tp=2, pp=4, virtual_stages=2, recompute="full", recompute_layers=1, overlap=True),
        Training(64, 1, tp=8, zero=3),
    ],
)
def test_every_stage_adds_up_to_the_step_and_the_slowest_is_the_breakdown(layout: Training) -> None:
    preset = get("dgx-h100")
    model = MODELS["llama3-8b"]
    row = plan(model, layout, preset.cluster(2), preset.gpu)
    stages = _sums(step_segments(row, model, layout, preset.gpu))
    assert sorted(stages) == list(range(layout.pp))
    for parts in stages.values():
        assert sum(parts.values()) == pytest.approx(row.step_s)
    slowest = dict(min(stages.values(), key=lambda p: p.get("pp_bubble_s", 0.0)))
    compute = slowest.pop("forward") + slowest.pop("backward", 0.0) + slowest.pop("recompute", 0.0)
    assert compute == pytest.approx(row.breakdown["compute_s"])
    assert slowest == pytest.approx({k: v for k, v in row.breakdown.items() if k != "compute_s" and v > 0})
    if layout.recompute != "none":
        assert all(p["recompute"] > 0 for p in stages.values())
    assert row.memory is not None
    memory = _sums(memory_segments(row, model, layout))
    for s in row.memory["stages"]:
        parts = memory[s["stage"]]
        assert parts["activations"] == pytest.approx(s["activations_GiB"])
        states = parts["weights"] + parts["gradients"] + parts["optimizer"]
        assert states == pytest.approx(s["weights_grads_optimizer_GiB"])
    if layout.zero == 1:  # the optimizer's 12 bytes a parameter sharded over dp x cp, the rest whole
        first = memory[0]
        shards = row.dp * layout.cp
        assert first["optimizer"] / first["weights"] == pytest.approx(12 / 2 / shards)
        assert first["gradients"] / first["weights"] == pytest.approx(4 / 2)


def test_plan_plot_draws_the_json_breakdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `plan --plot` draws, segment by segment, is what `plan --json` writes."""
    drawn: list[tuple[list[Segment], list[Segment]]] = []

    def keep(*args: Any, **kwargs: Any) -> tuple[list[Segment], list[Segment]]:
        drawn.append(draw_plan(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(plan_plot, "draw_plan", keep)
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    args = [*PLAN, "--tp", "4", "--pp", "2", "--recompute", "selective", "--json", str(out)]
    result = runner.invoke(app, [*args, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in result.output
    data = json.loads(out.read_text())
    ((steps, memory),) = drawn
    stages = _sums(steps)
    assert sorted(stages) == [s["stage"] for s in data["memory"]["stages"]] == [0, 1]
    pace = min(stages.values(), key=lambda p: p.get("pp_bubble_s", 0.0))
    assert pace["forward"] + pace["backward"] + pace["recompute"] == pytest.approx(
        data["breakdown"]["compute_s"]
    )
    for key, seconds in data["breakdown"].items():
        assert pace.get(key, 0.0) == pytest.approx(seconds) or key == "compute_s"
    assert all(sum(p.values()) == pytest.approx(data["step_s"]) for p in stages.values())
    for s in data["memory"]["stages"]:
        parts = _sums(memory)[s["stage"]]
        assert parts["activations"] == pytest.approx(s["activations_GiB"])
        assert parts["weights"] + parts["gradients"] + parts["optimizer"] == pytest.approx(
            s["weights_grads_optimizer_GiB"]
        )


def test_search_plot_and_from_run_plot_are_drawn(tmp_path: Path) -> None:
    png = tmp_path / "search.png"
    result = runner.invoke(app, [*PLAN, "--search", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 0
    summary = tmp_path / "run.json"
    summary.write_text(json.dumps({"parameters": 1_000_000, "step_time_s": 0.2, "world_size": 2}))
    png = tmp_path / "run.png"
    args = ["plan", "--from-run", str(summary), "--nodes", "2", "--cluster", "dgx-h100", "--plot", str(png)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 0
