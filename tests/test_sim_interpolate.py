"""Calibrated from nccl-tests logs, `sim` and `plan` read a logged GPU count's times off its rows.

Every other size of each log is held out: the calibration sees the rest, and the held-out sizes at
the logged counts (2, 4 and 8 GPUs) are predicted by log-log interpolation of the rows around them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.allreduce import allreduce_time
from ringtree.sim.network.measured import allreduce_seconds
from ringtree.sim.network.nccl_tests import parse
from ringtree.sim.network.spec import make_cluster

DATA = Path(__file__).parent / "data" / "nccl-tests"
LOGS = {2: "a100-1x2-bump.log", 4: "a100-1x4-bump.log", 8: "a100-1x8-galvatron.log"}
runner = CliRunner()


def held_out(log: str) -> tuple[str, set[int]]:
    """The log without every other size (the first and last kept), and the sizes taken out."""
    (run,) = parse(DATA / log)
    sizes = [r.nbytes for r in run.rows]
    out = {n for i, n in enumerate(sizes) if i % 2 == 1 and i < len(sizes) - 1}
    kept = [line for line in (DATA / log).read_text().splitlines() if not _row_of(line, out)]
    return "\n".join(kept) + "\n", out


def _row_of(line: str, sizes: set[int]) -> bool:
    words = line.split()
    return bool(words) and words[0].isdigit() and int(words[0]) in sizes


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("interp")
    files = []
    for log in LOGS.values():
        text, _ = held_out(log)
        (folder / log).write_text(text)
        files.append(str(folder / log))
    out = folder / "m.json"
    result = runner.invoke(app, ["calibrate", *files, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def errors(machine: Path, gpus: int, interpolate: bool) -> list[float]:
    (run,) = parse(DATA / LOGS[gpus])
    _, out = held_out(LOGS[gpus])
    cluster = make_cluster(1, gpus, calibration=machine)
    method = "auto" if interpolate else "closed-form"
    rows = [r for r in run.rows if r.nbytes in out]
    return [
        abs(
            allreduce_time("native", cluster, r.nbytes, method).seconds
            * 1e6
            / ((r.out_of_place_us + r.in_place_us) / 2)
            - 1
        )
        for r in rows
    ]


@pytest.mark.parametrize("gpus", sorted(LOGS))
def test_held_out_sizes_at_logged_counts_within_5_percent(machine: tuple[Path, str], gpus: int) -> None:
    path, _ = machine
    interpolated = errors(path, gpus, True)
    assert statistics.median(interpolated) <= 0.05
    assert statistics.median(interpolated) < statistics.median(errors(path, gpus, False))  # beats the fit


def test_sim_says_measured_and_the_model_fills_other_counts(machine: tuple[Path, str]) -> None:
    path, _ = machine
    at_4 = allreduce_time("native", make_cluster(1, 4, calibration=path), 3 << 20)
    assert at_4.method == "measured" and at_4.nccl  # NCCL's pick is still named
    at_6 = allreduce_time("native", make_cluster(1, 6, calibration=path), 3 << 20)
    assert at_6.method == "nccl-model"  # no log at 6 GPUs: the fitted model
    two_nodes = allreduce_time("native", make_cluster(2, 8, calibration=path), 3 << 20)
    assert two_nodes.method == "nccl-model"


def test_plan_reads_the_same_rows(machine: tuple[Path, str]) -> None:
    path, _ = machine
    cluster = make_cluster(1, 8, calibration=path)
    for nbytes in (3 << 20, 100 << 20):
        assert (
            allreduce_seconds("native", cluster, nbytes) == allreduce_time("native", cluster, nbytes).seconds
        )


def test_calibrate_prints_each_logs_residuals_and_what_is_interpolated(machine: tuple[Path, str]) -> None:
    _, output = machine
    flat = " ".join(output.split())
    for gpus, log in LOGS.items():
        assert f"{log}: {gpus} GPUs on 1 node" in flat
    assert "fit residuals rms" in flat and "interpolated" in flat
