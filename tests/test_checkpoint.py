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


def _two_saves(folder: Path) -> Path:
    for step in (10, 20):
        checkpoint.save(folder, {"step": step, "w": torch.randn(100)})
    return folder / "step-00000020.json"


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_or_missing_record_skips_its_checkpoint_naming_the_record(
    tmp_path: Path, damage: str
) -> None:
    record = _two_saves(tmp_path)
    if damage == "truncate":
        record.write_text(record.read_text()[:28])  # 'Unterminated string' from json
    else:
        record.unlink()
    reports: list[str] = []
    state = checkpoint.load(tmp_path, report=reports.append)
    assert state is not None and state["step"] == 10  # the previous verified checkpoint
    assert len(reports) == 1 and "step-00000020.json" in reports[0], reports
    assert ("damaged" if damage == "truncate" else "missing") in reports[0]


def test_an_unverifiable_checkpoint_that_loads_is_used_with_a_warning_when_none_verifies(
    tmp_path: Path,
) -> None:
    record = _two_saves(tmp_path)
    record.write_text("{")
    (tmp_path / "step-00000010.pt").write_bytes(b"junk")
    reports: list[str] = []
    state = checkpoint.load(tmp_path, report=reports.append)
    assert state is not None and state["step"] == 20
    assert "unverified" in reports[-1] and "step-00000020.pt" in reports[-1], reports


def test_last_pt_is_checked_against_the_record_of_the_step_it_links(tmp_path: Path) -> None:
    _two_saves(tmp_path)
    newest = tmp_path / "step-00000020.pt"
    with newest.open("r+b") as f:  # in place: last.pt, a hard link to it, is damaged too
        f.truncate(newest.stat().st_size // 2)
    with pytest.raises(checkpoint.CheckpointError, match=r"last\.pt is truncated"):
        checkpoint.read(tmp_path / "last.pt")


def test_a_record_passed_as_a_checkpoint_is_named_a_record(tmp_path: Path) -> None:
    record = _two_saves(tmp_path)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"record, not a checkpoint; pass .*step-00000020\.pt"
    ):
        checkpoint.read(record)


def test_a_teacher_folder_with_a_damaged_newest_uses_the_previous_one(tmp_path: Path) -> None:
    from torch import nn

    from ringtree.train.techniques.distill import load_teacher

    def build(name: str) -> nn.Module:
        return nn.Linear(2, 2)

    nets = [nn.Linear(2, 2) for _ in range(2)]
    for step, net in enumerate(nets, start=1):
        checkpoint.save(tmp_path, {"step": step, "model_name": "lin", "model": net.state_dict()})
    (tmp_path / "step-00000002.json").write_text("{")
    reports: list[str] = []
    for given in (tmp_path, tmp_path / "last.pt"):
        teacher = load_teacher(given, build, report=reports.append)[0]
        assert isinstance(teacher, nn.Linear)
        assert torch.equal(teacher.weight, nets[0].weight)  # step 1's weights, not step 2's
    assert len(reports) == 2 and all("step-00000002.json" in r for r in reports), reports


def test_inspect_reads_the_record_of_a_sharded_checkpoint_with_a_damaged_shard(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from ringtree.cli.app import app
    from ringtree.train import checkpointer, sharded_checkpoint

    folder = tmp_path / "step-00000007.dcp"  # what --zero saves: shards, metadata, ringtree's record
    folder.mkdir()
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", b"shard 0"), ("__1_0.distcp", b"shard 1")):
        (folder / name).write_bytes(data)
    files = {f.name: sharded_checkpoint.digest(f) for f in folder.iterdir()}
    layout = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "cp": 1, "zero": 1}
    record = {"step": 7, "model_name": "mlp", "layout": layout, "files": files}
    (folder / sharded_checkpoint.RECORD).write_text(json.dumps(record))
    (folder / "__1_0.distcp").write_bytes(b"damaged")
    report = checkpointer.inspect(tmp_path)
    assert (report["model_name"], report["step"], report["layout"]) == ("mlp", 7, layout)
    assert not report["verifies"] and "__1_0.distcp differs from the one recorded" in report["problem"]
    assert [f["bytes"] for f in report["files"]] == [4, 7, 7]  # as on disk: the damaged one its own
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert "sharded checkpoint of mlp at step 7, saved at 2 ranks" in result.output
