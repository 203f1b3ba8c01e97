"""`--mode dp-threads` and `dp-threads-balanced`: the seeds' single-process DataParallel in the trainer."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ringtree.cli.app import app


def _summary(tmp_path: Path, mode: str) -> dict[str, object]:
    out = tmp_path / f"{mode}.json"
    args = ["train", "--nproc", "1", "--mode", mode, "--threads", "3", "--epochs", "1", "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    summary: dict[str, object] = json.loads(out.read_text())
    return summary


def test_the_balanced_variant_evens_out_device_0s_load(tmp_path: Path) -> None:
    plain, balanced = _summary(tmp_path, "dp-threads"), _summary(tmp_path, "dp-threads-balanced")
    for s in (plain, balanced):
        assert s["devices"] == ["cpu", "cpu", "cpu"] and s["threads"] == 3 and s["world_size"] == 1
        assert "algorithm" not in s and "bucket_mb" not in s  # no effect in this mode: not echoed
        assert isinstance(s["final_loss"], float)
    held = plain["device_held_bytes"]
    assert isinstance(held, list) and held[0] > 2 * held[1]  # every output gathered on device 0
    assert float(plain["device_imbalance"]) > 1.5 > float(balanced["device_imbalance"])  # type: ignore[arg-type]
