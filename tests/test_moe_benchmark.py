"""benchmarks/moe.py's bookkeeping: the best algorithm by its median ratio, and the ceiling a free
all-to-all could reach when the step is the ranks' CPU work shared out."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load


def _variant(sps: float, cpu: float, a2a_cpu: float) -> dict[str, float]:
    return {
        "samples_per_s": sps,
        "step_time_s": 1 / sps,
        "a2a_time_s": 0.0,
        "a2a_exposed_fraction": 0.3,
        "cpu_s_per_step": cpu,
        "a2a_cpu_s_per_step": a2a_cpu,
    }


def test_the_summary_takes_the_best_ratio_and_bounds_it_by_the_cpu_work() -> None:
    moe = load("moe")
    variants = {name: _variant(100.0, 0.050, 0.001) for name in moe.VARIANTS}
    variants["native"] = _variant(100.0, 0.050, 0.001)
    variants["bruck"] = _variant(120.0, 0.045, 0.005)  # fastest by samples, not by its ratios
    ratios = {name: 1.0 for name in moe.VARIANTS} | {"linear": 1.15, "bruck": 1.10}
    result = {"variants": variants, "ratios_vs_native": ratios, "environment": {}}
    summary = moe.summarize(result, moe.Setup())
    assert summary["ringtree_algorithm"] == "linear"
    assert summary["ratio_ringtree_vs_native"] == 1.15
    # native does 50 ms of CPU work a step; linear 50 ms, 1 of it in its exchanges
    assert summary["ceiling_vs_native"] == pytest.approx(0.050 / 0.049)
    assert moe.ceiling(variants["bruck"], variants["native"]) == pytest.approx(0.050 / 0.040)
