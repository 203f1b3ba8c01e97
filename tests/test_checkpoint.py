"""Checkpoints: atomic, verified, the last K kept, and a damaged newest one skipped for the one before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringtree.train import checkpoint


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_failed_save_leaves_the_previous_checkpoints_and_no_stray_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.save(tmp_path, {"step": 1, "w": torch.ones(2)})
    before = _names(tmp_path)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, {"step": 2, "w": torch.zeros(2)})
    state = checkpoint.load(tmp_path)
    assert state is not None and state["step"] == 1
    assert _names(tmp_path) == before == ["last.pt", "step-00000001.json", "step-00000001.pt"]


def test_the_last_k_are_kept_and_last_pt_is_the_newest(tmp_path: Path) -> None:
    for step in range(1, 5):
        checkpoint.save(tmp_path, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
    assert _names(tmp_path) == [
        "last.pt",
        "step-00000003.json",
        "step-00000003.pt",
        "step-00000004.json",
        "step-00000004.pt",
    ]
    assert checkpoint.read(tmp_path / "last.pt")["step"] == 4
    with pytest.raises(ValueError, match="keep must be at least 1"):
        checkpoint.save(tmp_path, {"step": 5}, keep=0)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(
    tmp_path: Path, damage: str
) -> None:
    for step in (10, 20):
        checkpoint.save(tmp_path, {"step": step, "w": torch.randn(1000)})
    newest = tmp_path / "step-00000020.pt"
    data = bytearray(newest.read_bytes())
    (tmp_path / "last.pt").unlink()  # break the hard link so both names show the damage
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "last.pt").write_bytes(bytes(data))
    reports: list[str] = []
    state = checkpoint.load(tmp_path, report=reports.append)
    assert state is not None and state["step"] == 10
    why = "truncated" if damage == "truncate" else "cannot be read|corrupt"
    assert any("step-00000020.pt" in r for r in reports), reports
    assert all(any(w in r for w in why.split("|")) or "last.pt" in r for r in reports), reports


def test_no_usable_checkpoint_says_so_and_names_every_file(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path) is None  # an empty folder: a fresh start is right
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(
        checkpoint.CheckpointError, match=r"no usable checkpoint in .*last\.pt cannot be read"
    ):
        checkpoint.load(tmp_path)


def test_checkpoints_load_weights_only_and_name_the_file(tmp_path: Path) -> None:
    torch.save({"step": 3, "evil": Path("x")}, tmp_path / "last.pt")
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.load(tmp_path)
    message = str(caught.value)
    assert "last.pt cannot be read" in message
    assert "weights_only=False" not in message  # torch's advice would be unsafe to follow
