"""benchmarks/accuracy.py's bookkeeping: a row is the median of its rounds, and --model strips
what the planner may use of a calibration."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmark_scripts import load


def accuracy() -> ModuleType:
    return load("accuracy")


def run(step: float, predicted: float) -> dict[str, Any]:
    return {"model": "mlp", "nodes": 2, "one_node_step_s": 0.004, "predicted_step_s": predicted,
            "measured_step_s": step, "error": predicted / step - 1}  # fmt: skip


def test_row_is_the_median_of_its_rounds() -> None:
    row = accuracy().median_row([run(0.010, 0.006), run(0.004, 0.006), run(0.005, 0.006)])
    assert row["measured_step_s"] == pytest.approx(0.005) and row["repeats"] == 3
    assert row["measured_spread"] == pytest.approx((0.010 - 0.004) / 0.005)
    assert row["error"] == pytest.approx(0.006 / 0.005 - 1)
    # 2 x 4 ms / 6 ms > 1 predicted, 2 x 4 ms / 5 ms > 1 measured: right
    assert row["pays_off_predicted_correctly"] and row["measured_speedup"] == pytest.approx(1.6)


def test_model_option_strips_rows(tmp_path: Path) -> None:
    cal = tmp_path / "cal-1gbit.json"
    rows = [{"algorithm": a, "bytes": 1} for a in ("ring", "native")]
    cal.write_text(json.dumps({"measured": rows, "algorithms": {"ring": {}, "native": {}}}))
    bench = accuracy()
    assert bench.ablated(cal, "rows") == cal
    fit = json.loads(bench.ablated(cal, "fit").read_text())
    assert fit["measured"] == [] and fit["algorithms"] == {}
    ring = json.loads(bench.ablated(cal, "ring-rows").read_text())
    assert [r["algorithm"] for r in ring["measured"]] == ["ring"] and list(ring["algorithms"]) == ["ring"]
    assert bench.planned_as("native", tmp_path / "cal-1gbit-fit.json") == "ring"
    assert bench.planned_as("native", cal) == "native"
