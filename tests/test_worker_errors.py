"""A local worker's error reaches the user as one sentence: a refusal (ValueError, TypeError) with
exit code 2, any failure before training started with code 1; torch elastic's report (a traceback
per rank, the terminated peers) only for a failure mid-run. And the agent leaves no log folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ringtree.processes import WorkerError, elastic_spawn, training_started


def refuses(rank: int) -> None:
    raise ValueError("--colour red is not a colour this model knows; pass --colour blue")


def breaks_before_training(rank: int) -> None:
    raise RuntimeError(f"rank {rank} found no data")


def breaks_mid_run(rank: int) -> None:
    training_started()
    raise RuntimeError("a kernel failed")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tempfile's folder, where torch's agent would leave its torchelastic_* logs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_workers_refusal_is_its_one_sentence_and_leaves_nothing(
    private_tmp: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(WorkerError) as caught:
        elastic_spawn(refuses, 2)
    assert caught.value.code == 2
    assert caught.value.message == "--colour red is not a colour this model knows; pass --colour blue"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "exitcode" not in err and "Terminating" not in err, err
    assert list(private_tmp.iterdir()) == []  # no torchelastic_* log folder, no said-* file


def test_a_failure_before_training_names_the_rank_and_the_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerError) as caught:
        elastic_spawn(breaks_before_training, 2)
    assert caught.value.code == 1
    assert caught.value.message in {
        f"rank {r} failed before training started: RuntimeError: rank {r} found no data" for r in (0, 1)
    }
    assert "Traceback" not in capfd.readouterr().err


def test_a_failure_mid_run_is_torchs_report(private_tmp: Path) -> None:
    with pytest.raises(ChildFailedError):
        elastic_spawn(breaks_mid_run, 1)
    assert list(private_tmp.glob("torchelastic_*")) == []
