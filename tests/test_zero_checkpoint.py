"""Sharded checkpoints (torch.distributed.checkpoint): saved by 4 ZeRO-3 ranks, loaded by 2 ZeRO-2
ranks and by ZeRO 0 (dense), the same values; a missing or foreign shard named; --zero refusals."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.parallel import ShardedDataParallel
from ringtree.processes import spawn
from ringtree.train import sharded_checkpoint
from ringtree.train.checkpoint import CheckpointError
from ringtree.train.layout import Place, whole

BUCKET_MB = 2000 / (1 << 20)


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 31), nn.ReLU(), nn.Linear(31, 5))


def sharded(rank: int, zero: int) -> tuple[nn.Module, ShardedDataParallel, torch.optim.Optimizer]:
    net = make_net(rank)
    model = ShardedDataParallel(net, zero=zero, bucket_cap_mb=BUCKET_MB)
    return net, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def names(net: nn.Module) -> dict[int, Place]:
    return whole(net)


def case_save(rank: int, folder: str, seed: int = 0) -> None:
    """Two AdamW steps at ZeRO 3, then a save at step 2."""
    net, model, opt = sharded(rank, 3)
    g = torch.Generator().manual_seed(rank + seed)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    sharded_checkpoint.save(folder, 2, "net", model, opt, names(net), {}, keep=2)


def case_save_two(rank: int, first: str, second: str) -> None:
    case_save(rank, first)
    case_save(rank, second, seed=100)  # another save of the same layout: its shards differ


def case_reshard(rank: int, source: str, folder: str) -> None:
    """Load at ZeRO 2 on 2 ranks and save again: every value must survive the new cut."""
    net, model, opt = sharded(rank + 10, 2)  # other initial values: the load must overwrite them
    found = sharded_checkpoint.find(source)
    assert found is not None
    sharded_checkpoint.load_sharded(found[0], model, opt, names(net), net)
    sharded_checkpoint.save(folder, 2, "net", model, opt, names(net), {}, keep=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """four/ and other/: saved by 4 ZeRO-3 ranks; two/: four/ loaded and saved again by 2 ZeRO-2 ranks."""
    root = tmp_path_factory.mktemp("zero-ck")
    spawn(case_save_two, 4, (str(root / "four"), str(root / "other")), timeout_s=120)
    spawn(case_reshard, 2, (str(root / "four"), str(root / "two")), timeout_s=120)
    return root


def dense(folder: Path) -> dict[str, Any]:
    found = sharded_checkpoint.find(folder)
    assert found is not None
    net = make_net(99)
    dense = [(n, tuple(p.shape)) for n, p in net.named_parameters()]
    return sharded_checkpoint.dense_state(found[0], dense, torch.optim.AdamW(net.parameters()))


def test_saved_at_4_loads_at_2_and_dense(saved: Path) -> None:
    four, two = dense(saved / "four"), dense(saved / "two")
    assert four["step"] == 2 and four["model_name"] == "net"
    for key, value in four["model"].items():
        assert torch.equal(value, two["model"][key]), key
    assert not torch.equal(four["model"]["0.weight"], make_net(0)[0].weight.detach())  # it trained
    assert len(four["optimizer"]["state"]) == 6
    for j, state in four["optimizer"]["state"].items():
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[kind], two["optimizer"]["state"][j][kind]), (j, kind)
    net = make_net(5)  # ZeRO 0 resumes from it: a dense model and optimizer load it
    opt = torch.optim.AdamW(net.parameters())
    net.load_state_dict(four["model"])
    opt.load_state_dict(four["optimizer"])
    assert torch.equal(net[2].bias.detach(), four["model"]["2.bias"])


def test_missing_or_foreign_shard_is_named(saved: Path, tmp_path: Path) -> None:
    step = "step-00000002.dcp"
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(saved / "four", a)
    shutil.copytree(saved / "other", b)
    shutil.copy(b / step / "__1_0.distcp", a / step / "__1_0.distcp")
    differs = re.escape(f"{step}/__1_0.distcp differs from the one recorded")
    with pytest.raises(CheckpointError, match=differs):
        sharded_checkpoint.find(a)
    (b / step / "__3_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{step}/__3_0.distcp is missing")):
        sharded_checkpoint.find(b)
    result = CliRunner().invoke(app, ["train", "--zero", "3", "--resume", "--checkpoint-dir", str(b)])
    assert result.exit_code == 2 and "__3_0.distcp is missing" in re.sub(r"[\s│]+", " ", result.output)
    assert "Traceback" not in result.output


def test_a_save_cut_short_leaves_the_previous_one(saved: Path, tmp_path: Path) -> None:
    shutil.copytree(saved / "four", tmp_path, dirs_exist_ok=True)
    (tmp_path / ".step-00000004.dcp.tmp").mkdir()  # a save that died before its rename
    (tmp_path / ".step-00000004.dcp.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-00000003.dcp").mkdir()  # one renamed without its record: skipped, reported
    said: list[str] = []
    found = sharded_checkpoint.find(tmp_path, report=said.append)
    assert found is not None and found[1]["step"] == 2
    assert said and "ringtree.json is missing" in said[0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--zero", "4"], "--zero 4 is not a ZeRO stage; choose 0 (DDP), 1, 2 or 3"),
        (["--zero", "1", "--mode", "dp"], "--zero 1 shards DDP's data parallelism, which --mode dp"),
        (["--zero", "2", "--mode", "dp-threads", "--nproc", "1"], "which --mode dp-threads does not run"),
        (["--zero", "3", "--algorithm", "double_tree"], "has no reduce-scatter/all-gather schedule"),
        (["--zero", "2", "--compression", "bf16"], "not supported with --zero 2"),
    ],
)
def test_zero_refusals_exit_2(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert fragment in re.sub(r"[\s│]+", " ", result.output)
    assert "Traceback" not in result.output


def test_a_sharded_checkpoint_is_a_teacher(saved: Path) -> None:
    from ringtree.train.techniques.distill import load_teacher, teacher_file

    assert teacher_file(saved / "four") == saved / "four"  # the folder, not a last.pt inside it
    teacher, name = load_teacher(saved / "four", lambda kind: make_net(1))
    assert name == "net" and not teacher.training
    expected = dense(saved / "four")["model"]
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, expected[key]), key
