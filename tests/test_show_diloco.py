"""`ringtree show diloco`: the fragments' synchronisations in the text, the JSON and the picture are
the schedule the trainer runs (ringtree.schedules.outer); bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

from json_tables import documented, keys
from test_bad_input import _exits_2
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.schedules.outer import OuterSchedule


def test_text_json_and_png_follow_the_schedule(tmp_path: Path) -> None:
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    args = ["show", "diloco", "--replicas", "3", "--fragments", "2", "--overlap-steps", "1"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--png", str(png)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert (
        "3 replicas, H = 8 inner steps, 2 fragments (one every H/F = 4 steps), overlap T = 1" in result.output
    )
    assert "f1 send" in result.output and "f0 all-reduce in flight" in result.output
    doc = json.loads(out.read_text())
    assert sorted(keys(doc)) == sorted(documented("how-to/train-across-a-slow-network.md", "show-diloco"))
    expected = OuterSchedule(8, 2, 1).syncs(16)
    assert [(s["fragment"], s["sent_after"], s["applied_after"]) for s in doc["syncs"]] == [
        (x.fragment, x.start, x.end) for x in expected
    ]
    assert [s["step"] for s in doc["steps"] if s["applies"]] == [4, 8, 12, 16]  # one fragment per H/F
    assert doc["bytes_per_sync"] == 0.5
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plain_diloco_blocks_every_h_steps(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    args = ["show", "diloco", "--inner-steps", "3", "--json", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [(s["sent_after"], s["applied_after"]) for s in doc["syncs"]] == [(3, 3), (6, 6)]
    assert "average (blocking)" in result.output


def test_bad_input_exits_2(tmp_path: Path) -> None:
    _exits_2(tmp_path, ["show", "diloco", "--inner-steps", "8", "--fragments", "2", "--overlap-steps", "4"],
             "--overlap-steps")  # fmt: skip
    _exits_2(tmp_path, ["show", "diloco", "--fragments", "3", "--inner-steps", "4"], "--fragments")
    _exits_2(tmp_path, ["show", "ring", "--replicas", "2"], "--replicas applies to `ringtree show diloco`")
    _exits_2(tmp_path, ["show", "diloco", "--ranks", "2"], "--ranks does not apply to diloco")
