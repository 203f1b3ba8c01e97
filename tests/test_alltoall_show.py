"""`ringtree show` for all-to-all: the step table, the JSON, the picture and the alpha-beta cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.show import alltoall as a2a
from ringtree.show.cost import make_cluster


def test_bruck_on_4_ranks_forwards_then_delivers() -> None:
    w = a2a.walk("bruck", 4, 4096)
    first, second = w.steps[0][0], w.steps[1][0]
    assert a2a.moves_text(first) == ["→1: 0→1 0→3", "←3: 3→0 3→2"]
    assert a2a.holds_text(first, 4) == "output from 3; forwards 3→2"
    assert a2a.holds_text(second, 4) == "output from all"
    (charge,) = a2a.cost(w, make_cluster(4, 1, "bw=1GB/s,lat=10us", None))
    assert (charge.messages, charge.nbytes) == (2, 4096)  # lg p messages of half the buffer


def test_pairwise_and_hierarchical_costs_follow_the_textbook() -> None:
    (pair,) = a2a.cost(a2a.walk("pairwise", 8, 8192), make_cluster(8, 1, "eth-10g", None))
    assert (pair.messages, pair.nbytes) == (7, 7 * 1024)  # (p-1)·α + (p-1)/p·n·β
    inside, across = a2a.cost(a2a.walk("hierarchical", 8, 8192, 2), make_cluster(8, 2, "eth-10g", None))
    assert (inside.link.name, inside.messages, inside.nbytes) == ("pcie-gen3", 3, 3 * 2048)
    assert (across.link.name, across.messages, across.nbytes) == ("eth-10g", 1, 4096)  # L·m in one


def test_show_writes_table_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "a2a.json", tmp_path / "a2a.png"
    args = ["show", "pairwise", "--ranks", "3", "--bytes", "3K", "--json", str(out), "--png", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "→1: 0→1" in result.output and "(p-1)·α" in result.output
    doc = json.loads(out.read_text())
    assert doc["collective"] == "all_to_all" and len(doc["steps"]) == 2
    assert doc["steps"][0]["ranks"][0]["sends"] == [{"to": 1, "blocks": [[0, 1]], "bytes": 1024}]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bruck", "--root", "1"], "--root does not apply to an all-to-all"),
        (["ring", "--collective", "all-to-all"], "unknown all_to_all algorithm 'ring'"),
        (["linear", "--ranks", "9", "--png", "x.png"], "8 or fewer"),
        (["bruck", "--collective", "all_reduce"], "not all_reduce; drop --collective"),
    ],
)
def test_show_refuses_what_does_not_apply(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["show", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split()), (
        result.output
    )
