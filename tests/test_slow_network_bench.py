"""benchmarks/slow_network.py's arithmetic: medians over rounds, ratios against DDP, bytes per
synchronisation from the interface, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmark_scripts import load


def _run(
    method: str,
    samples_per_s: float,
    sent: float,
    accuracy: float,
    syncs: int | None = None,
    round_id: int = 0,
) -> dict[str, Any]:
    return {
        "method": method, "model": "wide-mlp", "inter_bw": "100mbit", "samples_per_s": samples_per_s,
        "step_time_s": 96 / samples_per_s,
        "steps": 640, "accuracy": accuracy, "test_loss": 0.1, "link_bytes_per_step": sent,
        "reported_bytes_per_step": None, "parameters": 216586, "global_batch": 96, "algorithm": "ring",
        "outer_syncs": syncs, "round": round_id,
    }  # fmt: skip


def test_rows_are_medians_and_ratios_are_against_ddp() -> None:
    bench = load("slow_network")
    ddp = bench.median_row([_run("ddp", 6000, 150_000, 0.97), _run("ddp", 5000, 150_000, 0.97, round_id=1),
                            _run("ddp", 7000, 150_000, 0.97, round_id=2)])  # fmt: skip
    assert ddp["samples_per_s"] == 6000 and ddp["rounds"] == 3
    diloco = bench.median_row([_run("diloco-h64", 45_000, 2_400, 0.96, syncs=10)])
    rows = bench.summarise([ddp, diloco], calibrations={})  # no compute run: no utilisation, no planner
    assert rows[1]["speed_vs_ddp"] == 7.5 and rows[1]["bytes_vs_ddp"] == 0.016
    assert abs(rows[1]["accuracy_vs_ddp_points"] - (-1.0)) < 1e-9 and "compute_utilisation" not in rows[1]
    assert "link_bytes_per_sync" not in rows[1]  # it needs the compute run's bytes
    text = bench.table(rows)
    assert "| 100mbit | diloco-h64 | 45,000 | - | 7.50 | 2,400 | 0.0160 | - | 0.9600 | -1.0 |" in text


def test_utilisation_is_the_median_of_each_rounds_own_ratio() -> None:
    bench = load("slow_network")
    compute = bench.median_row([_run("compute", 50_000, 4_000, 0.97, round_id=0),
                                _run("compute", 30_000, 4_000, 0.97, round_id=1)])  # fmt: skip
    diloco = bench.median_row([_run("diloco-h64", 45_000, 20_000, 0.97, syncs=10, round_id=0),
                               _run("diloco-h64", 30_000, 20_000, 0.97, syncs=10, round_id=1)])  # fmt: skip
    assert abs(bench.per_round_ratio(diloco, compute) - 0.95) < 1e-12  # rounds 0.9 and 1.0
    assert abs(diloco["samples_per_s"] / compute["samples_per_s"] - 0.9375) < 1e-12  # not the medians'
    lone = bench.median_row([_run("diloco-h16", 20_000, 80_000, 0.97, syncs=40, round_id=5)])
    assert bench.per_round_ratio(lone, compute) == 0.5  # no round in common: the medians' ratio


def test_the_planner_is_set_beside_each_round_with_that_rounds_compute_step_and_work(
    monkeypatch: Any,
) -> None:
    bench = load("slow_network")
    seen: list[tuple[float, float | None]] = []

    def plan(row: dict[str, Any], calibration: Any, step: float, work: float | None) -> float:
        seen.append((step, work))  # a planner that adds 10 ms of link to the step and the work
        return float(row["global_batch"]) / (step + (work or 0.0) + 0.010)

    monkeypatch.setattr(bench, "predicted_samples_per_s", plan)
    compute = bench.median_row([_run("compute", 9600, 0, 0.97, round_id=0),  # a 10 ms step
                                _run("compute", 4800, 0, 0.97, round_id=1),  # the host at half speed
                                _run("compute", 3200, 0, 0.97, round_id=2)])  # fmt: skip
    runs = [_run("powersgd-r4", 2400, 1_000, 0.97, round_id=k) for k in (1, 2, 7)]  # 7: no compute run
    for r, work in zip(runs, (0.010, 0.020, 0.5), strict=True):
        r["powersgd_compute_s"] = work
    predicted, ratio = bench.planned(bench.median_row(runs), compute, calibration={})
    assert seen == [(0.020, 0.010), (0.030, 0.020)]  # each round's own step and work, not medians
    # round 1: 96 / 40 ms = 2400 (1.0 of measured), round 2: 96 / 60 ms = 1600 (2/3): the medians
    assert abs(ratio - 5 / 6) < 1e-12 and abs(predicted - 2000) < 1e-9
    lone = bench.median_row([_run("ddp", 1000, 1_000, 0.97, round_id=9)])
    assert abs(bench.planned(lone, compute, calibration={})[0] - 96 / (0.020 + 0.010)) < 1e-9  # medians


def test_bytes_per_sync_take_out_what_every_run_sends() -> None:
    bench = load("slow_network")
    base = 1_000_000 + 640 * 100  # what every run sends: the start's copy, small collectives a step
    # the compute run: one sync (training's end) of 1,000,000 bytes; DiLoCo: 10
    compute = _run("compute", 50_000, (base + 1 * 1_000_000) / 640, 0.97, syncs=1)
    diloco = _run("diloco-h64", 45_000, (base + 10 * 1_000_000) / 640, 0.97, syncs=10)
    assert abs(bench.bytes_per_sync(diloco, compute) - 1_000_000) < 1e-6
    assert bench.bytes_per_sync(compute, compute) is None  # no sync beyond the compute run's
    # Streaming DiLoCo at the same H: 43 fragment syncs of 60,000 bytes
    streaming = _run("streaming-f4", 48_000, (base + 43 * 60_000) / 640, 0.97, syncs=43)
    diloco["link_bytes_per_sync"] = bench.bytes_per_sync(diloco, compute)
    assert abs(bench.fragment_bytes_per_sync(streaming, diloco) - 60_000) < 1e-6


def test_bad_options_exit_2_naming_the_option(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "slow_network.py"
    for args, words in (
        (["--replan"], "--replan"),
        (["--append"], "--append"),
        (["--cpus", "x"], "--cpus"),
        (["--methods", "nope"], "--methods"),
        (["--cpus-per-node", "lots"], "--cpus-per-node"),
        (["--cpus-per-node", "5"], "--cpus-per-node 5 on 3 nodes"),
    ):
        done = subprocess.run(
            [sys.executable, str(script), "--json", str(tmp_path / "a.json"), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written
