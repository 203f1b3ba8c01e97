"""benchmarks/slow_network.py's arithmetic: medians over rounds, ratios against DDP, the table."""

from __future__ import annotations

from typing import Any

from benchmark_scripts import load


def _run(method: str, samples_per_s: float, sent: float, accuracy: float) -> dict[str, Any]:
    return {
        "method": method, "model": "mlp", "inter_bw": "100mbit", "samples_per_s": samples_per_s,
        "step_time_s": 96 / samples_per_s,
        "steps": 300, "accuracy": accuracy, "test_loss": 0.1, "link_bytes_per_step": sent,
        "reported_bytes_per_step": None, "parameters": 26122, "global_batch": 96,
    }  # fmt: skip


def test_rows_are_medians_and_ratios_are_against_ddp() -> None:
    bench = load("slow_network")
    ddp = bench.median_row([_run("ddp", 6000, 150_000, 0.97), _run("ddp", 5000, 150_000, 0.97),
                            _run("ddp", 7000, 150_000, 0.97)])  # fmt: skip
    assert ddp["samples_per_s"] == 6000 and ddp["rounds"] == 3
    diloco = bench.median_row([_run("diloco-h64", 45_000, 2_400, 0.96)])
    rows = bench.summarise([ddp, diloco], links={})  # no compute run: no utilisation, no planner
    assert rows[1]["speed_vs_ddp"] == 7.5 and rows[1]["bytes_vs_ddp"] == 0.016
    assert abs(rows[1]["accuracy_vs_ddp_points"] - (-1.0)) < 1e-9 and "compute_utilisation" not in rows[1]
    text = bench.table(rows)
    assert "| 100mbit | diloco-h64 | 45,000 | - | 7.50 | 2,400 | 0.0160 | 0.9600 | -1.0 |" in text
