"""MoE and expert parallelism from the command line: bad input refused before any process starts
(exit 2, one sentence naming the flag), the library's TrainConfig speaking field names, and
`ringtree show moe-dispatch`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.show.moe import dispatch_steps
from ringtree.train import TrainConfig
from ringtree.train.config import ConfigError

CASES: list[tuple[list[str], str]] = [
    (["train", "--model", "moe", "--ep", "3", "--nproc", "3"], "--ep 3 must divide --experts 8"),
    (
        ["train", "--model", "moe", "--ep", "4", "--nproc", "2"],
        "--ep 4 must divide the 2 data-parallel ranks",
    ),
    (["train", "--model", "moe", "--ep", "2", "--tp", "2", "--nproc", "2"], "--ep 2 must divide the 1 data"),
    (["train", "--model", "moe", "--top-k", "9"], "--top-k 9 is above --experts 8"),
    (["train", "--model", "moe", "--experts", "2", "--top-k", "3"], "--top-k 3 is above --experts 2"),
    (["train", "--model", "moe", "--capacity-factor", "0"], "--capacity-factor must be positive"),
    (["train", "--model", "moe", "--capacity-factor", "-1.5"], "--capacity-factor must be positive"),
    (["train", "--experts", "4"], "--experts configures --model moe's layers"),
    (["train", "--ep", "2", "--nproc", "2"], "--ep 2 splits the experts of MoE layers, and MLP has none"),
    (["train", "--model", "moe", "--a2a-algorithm", "bruck"], "--a2a-algorithm dispatches tokens among --ep"),
    (
        ["train", "--model", "moe", "--ep", "2", "--a2a-algorithm", "ring", "--nproc", "2"],
        "a2a_algorithm 'ring'",
    ),
    (
        ["train", "--model", "moe", "--shared-experts", "1", "--no-moe-shared-expert-overlap"],
        "--moe-shared-expert-overlap/--no-moe-shared-expert-overlap overlaps the all-to-alls of --ep ranks",
    ),
    (
        ["train", "--model", "moe", "--ep", "2", "--nproc", "2", "--moe-shared-expert-overlap"],
        "which --model moe has without --shared-experts 1 or more",
    ),
    (["train", "--model", "moe", "--router-score", "relu"], "unknown router_score 'relu'"),
    (["show", "moe-dispatch", "--ranks", "3"], "--ranks 3 must divide --experts 8"),
    (["show", "ring", "--experts", "4"], "--experts does not apply to ring"),
]


def _one_sentence(output: str) -> str:
    lines = [line.strip(" │╭╮╰╯─") for line in output.splitlines() if line.startswith("│")]
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


@pytest.mark.parametrize(("args", "fragment"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_moe_input_exits_2_naming_the_flag(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert fragment in _one_sentence(result.output), result.output


def test_the_library_names_fields() -> None:
    with pytest.raises(ConfigError, match=r"top_k=3 is above experts=2"):
        TrainConfig(model="moe", experts=2, top_k=3)
    assert TrainConfig(model="moe", dataset="sort", ep=2).ep == 2


def test_show_moe_dispatch_conserves_every_copy(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    result = CliRunner().invoke(
        app, ["show", "moe-dispatch", "--ranks", "4", "--experts", "8", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    steps = data["steps"]
    assert [s["communication"].split(",")[0] for s in steps].count("all-to-all") == 5  # counts + 4
    dispatch = next(s for s in steps if s["action"].startswith("dispatch"))
    combine = next(s for s in steps if s["action"].startswith("combine"))
    assert sum(map(sum, dispatch["sends"])) == 4 * data["tokens"] * data["top_k"]
    assert combine["sends"] == [list(row) for row in zip(*dispatch["sends"], strict=True)]  # transposed


def test_dispatch_steps_refuse_ranks_that_do_not_divide_the_experts() -> None:
    with pytest.raises(ValueError, match="must divide"):
        dispatch_steps(3, 8)
