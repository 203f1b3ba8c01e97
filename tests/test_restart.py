"""Kill and resume: a worker SIGKILLed mid-run is restarted by torch's elastic agent and the run
resumes from its newest checkpoint, ending with the parameters of a run that was never killed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ringtree.cli.app import app

RUN = ["train", "--dataset", "restart_data:digits_that_die", "--epochs", "1", "--checkpoint-every", "4"]


def _train(args: list[str], folder: Path) -> dict[str, object]:
    folder.mkdir()
    out = folder / "summary.json"
    result = CliRunner().invoke(app, [*RUN, *args, "--checkpoint-dir", str(folder), "--json", str(out)])
    assert result.exit_code == 0, result.output
    import json

    summary: dict[str, object] = json.loads(out.read_text())
    return summary


# (layout, samples rank 1 reads before it dies, the checkpoint the run must resume from): DP reads
# 32 samples a step (dies in step 10, resumes at 8); DP x PP 4 micro-batches of 32 (dies in step 5,
# resumes at 4). Checkpoints every 4 steps.
LAYOUTS = [
    (["--nproc", "2"], 300, 8),
    pytest.param(["--nproc", "4", "--pp", "2"], 600, 4, marks=pytest.mark.slow),  # 40 s on 2 cores
]


@pytest.mark.parametrize(("layout", "kill_after", "resumed"), LAYOUTS, ids=["dp2", "dp2xpp2"])
def test_a_killed_worker_resumes_and_ends_where_an_uninterrupted_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: list[str], kill_after: int, resumed: int
) -> None:
    whole = _train(layout, tmp_path / "whole")
    monkeypatch.setenv("RINGTREE_TEST_KILL_AFTER", str(kill_after))
    killed = _train([*layout, "--max-restarts", "1"], tmp_path / "killed")
    assert whole["restarts"] == 0 and killed["restarts"] == 1
    assert killed["resumed_from_step"] == resumed  # the newest checkpoint before the kill
    assert killed["steps"] == whole["steps"]
    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


SHARDED = ["--zero", "3", "--model", "restart_data:tiny_tp", "--lr", "3e-3", "--checkpoint-every", "2"]


def _accuracy_within_a_point(killed: dict[str, object], whole: dict[str, object]) -> None:
    assert abs(float(killed["accuracy"]) - float(whole["accuracy"])) <= 0.01  # type: ignore[arg-type]


# 27 s on 2 cores; covered by test_a_killed_worker_resumes_and_ends_where_an_uninterrupted_run_ends[dp2]
# (kill, restart, resume) and test_zero_checkpoint.py::test_a_save_cut_short_leaves_the_previous_one.
@pytest.mark.slow
def test_a_kill_during_a_sharded_save_resumes_from_the_one_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP 2 under ZeRO-3: rank 1 dies writing the 3rd checkpoint (step 6); the run resumes at 4."""
    layout = [*SHARDED, "--nproc", "2"]
    whole = _train(layout, tmp_path / "whole")
    monkeypatch.setenv("RINGTREE_TEST_KILL_IN_SAVE", "3")
    killed = _train([*layout, "--max-restarts", "1"], tmp_path / "killed")
    assert killed["restarts"] == 1 and killed["resumed_from_step"] == 4
    assert killed["steps"] == whole["steps"]
    _accuracy_within_a_point(killed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid-run", "mid-save"])
def test_a_killed_worker_under_zero3_tp2_pp2_at_8_ranks_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    layout = [*SHARDED, "--nproc", "8", "--tp", "2", "--pp", "2"]
    whole = _train(layout, tmp_path / "whole")
    if where == "mid-run":  # 4 micro-batches of 32 a step: dies in step 5
        monkeypatch.setenv("RINGTREE_TEST_KILL_AFTER", "600")
    else:
        monkeypatch.setenv("RINGTREE_TEST_KILL_IN_SAVE", "2")  # the save at step 4
    killed = _train([*layout, "--max-restarts", "1"], tmp_path / "killed")
    assert killed["restarts"] == 1 and killed["resumed_from_step"] == (4 if where == "mid-run" else 2)
    assert killed["steps"] == whole["steps"]
    _accuracy_within_a_point(killed, whole)


MOE = ["--model", "moe", "--dataset", "restart_data:sort_that_dies", "--epochs", "2", "--batch-size", "16"]


@pytest.mark.slow
def test_a_killed_worker_of_an_expert_parallel_run_resumes_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MoE, EP 2 x ZeRO 1 on 4 ranks, 4 steps an epoch of 16 sequences a rank, saved every 2 steps:
    rank 1 dies reading its 89th sequence (step 6) and the run resumes from step 4."""
    layout = [*MOE, "--nproc", "4", "--ep", "2", "--zero", "1", "--checkpoint-every", "2"]
    whole = _train(layout, tmp_path / "whole")
    monkeypatch.setenv("RINGTREE_TEST_KILL_AFTER", "88")
    killed = _train([*layout, "--max-restarts", "1"], tmp_path / "killed")
    assert killed["restarts"] == 1 and killed["resumed_from_step"] == 4
    assert (killed["ep"], killed["steps"]) == (2, whole["steps"]) == (2, 8)
    for key in ("final_loss", "test_loss", "accuracy", "expert_load"):
        assert killed[key] == whole[key], key
