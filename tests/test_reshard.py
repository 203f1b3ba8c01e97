"""Checkpoints that move between layouts: a library user's own model (an nn.Sequential with a TP
plan) saved at TP 2 x DP 2 under ZeRO-3 resumes at TP 1 x DP 4, TP 4 x DP 1, TP 2 x PP 2 (ZeRO-1)
and under DDP, each with the saved parameters (<= 1e-6); `ringtree checkpoint consolidate` gives
one dense file torch.load loads into the plain model; `inspect` says what the folder holds."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer, tensor_parallel

BASE = TrainConfig(epochs=1, batch_size=8, lr=1e-2, progress=False, bucket_mb=0.0005)
LAYOUTS = {  # name: (tp, pp, zero); the rest of the 4 ranks is DP
    "tp1xdp4": (1, 1, 3),
    "tp4xdp1": (4, 1, 3),
    "tp2xpp2": (2, 2, 1),
    "ddp_tp2": (2, 1, 0),
}


class Regressor(nn.Sequential):
    """A user's model: its own TP plan (column then row parallel), nothing of ringtree's."""

    tp_plan: ClassVar[dict[str, str]] = {"0": "colwise", "2": "rowwise"}


def regression(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def regressor() -> Regressor:
    torch.manual_seed(4)
    return Regressor(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))


def dense_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained parameters gathered to the dense shapes (collective over the TP group)."""
    dense = [(n, tuple(p.shape)) for n, p in regressor().named_parameters()]
    return {k: v.clone() for k, v in tensor_parallel.model_state(trainer.net, dense).items()}


def runs(rank: int, root: str) -> dict[str, Any]:
    saved = replace(BASE, tp=2, zero=3, checkpoint_dir=f"{root}/saved")
    first = Trainer(regressor(), regression(), nn.MSELoss(), saved, test_dataset=regression())
    out: dict[str, Any] = {"saved": (first.fit(), dense_params(first))}
    for name, (tp, pp, zero) in LAYOUTS.items():
        if rank == 0:
            shutil.copytree(f"{root}/saved", f"{root}/{name}")
        dist.barrier()
        cfg = replace(BASE, tp=tp, pp=pp, zero=zero, checkpoint_dir=f"{root}/{name}", resume=True)
        if tp * pp == 4:  # DP 1: as many samples per step as the saved run's DP 2 (its epoch is done)
            cfg = replace(cfg, micro_batches=2) if pp > 1 else replace(cfg, batch_size=16)
        trainer = Trainer(regressor(), regression(), nn.MSELoss(), cfg)  # nothing left to train
        out[name] = (trainer.fit(), dense_params(trainer))
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("reshard")
    return root, spawn(runs, 4, (str(root),), timeout_s=240)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_at_tp2_dp2_resumes_in_another_layout_with_the_saved_parameters(
    resumed: tuple[Path, dict[str, Any]], layout: str
) -> None:
    _, out = resumed
    summary, params = out[layout]
    tp, pp, _ = LAYOUTS[layout]
    assert (summary["tp"], summary["pp"], summary["dp"]) == (tp, pp, 4 // (tp * pp))
    assert summary["resumed_from_step"] == out["saved"][0]["steps"] == summary["steps"] > 0
    for name, value in out["saved"][1].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6, msg=name)


def test_consolidate_loads_into_the_plain_model(resumed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, out = resumed
    target = tmp_path / "dense.pt"
    result = CliRunner().invoke(app, ["checkpoint", "consolidate", str(root / "saved"), str(target)])
    assert result.exit_code == 0, result.output
    plain = regressor()
    plain.load_state_dict(torch.load(target, weights_only=True))
    for name, value in out["saved"][1].items():
        torch.testing.assert_close(dict(plain.named_parameters())[name].detach(), value, rtol=0, atol=1e-6)
    x, y = regression().tensors
    with torch.no_grad():
        loss = float(nn.functional.mse_loss(plain(x), y))
    assert (
        abs(loss - out["saved"][0]["test_loss"]) <= 1e-5 * max(1.0, loss)
        or out["saved"][0]["test_loss"] is None
    )


def test_inspect_names_the_layout_and_every_shard(resumed: tuple[Path, dict[str, Any]]) -> None:
    root, out = resumed
    target = root / "inspect.json"
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(root / "saved"), "--json", str(target)])
    assert result.exit_code == 0, result.output
    said = json.loads(target.read_text())
    assert said["step"] == out["saved"][0]["steps"] and said["verifies"] is True
    assert said["layout"] == {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "cp": 1, "zero": 3}
    assert len(said["files"]) >= 4 and all(len(f["sha256"]) == 64 for f in said["files"])


def narrower() -> Regressor:
    """The user's model with another hidden width: not the one the checkpoint holds."""
    return Regressor(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 1))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    return regression(), regression()


def _refused(args: list[str], *fragments: str) -> None:
    result = CliRunner().invoke(app, args)
    said = re.sub(r"[\s│]+", " ", result.output)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in said, said


def test_bad_input_exits_2_naming_it_and_writes_nothing(
    resumed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = resumed
    ck = tmp_path / "ck"
    shutil.copytree(root / "saved", ck)
    before = sorted(p.name for p in ck.rglob("*"))
    model = ["--model", "test_reshard:narrower", "--dataset", "test_reshard:datasets", "--nproc", "1"]
    _refused(["train", *model, "--resume", "--checkpoint-dir", str(ck)], "'0.weight' has shape (16, 8)")
    assert sorted(p.name for p in ck.rglob("*")) == before
    _refused(["checkpoint", "inspect", str(tmp_path)], "holds no checkpoint")
    shard = next(ck.glob("step-*.dcp")) / "__1_0.distcp"
    shard.write_bytes(b"damaged")
    out = tmp_path / "dense.pt"
    _refused(["checkpoint", "consolidate", str(ck), str(out)], "__1_0.distcp differs from the one recorded")
    assert not out.exists()


def test_a_checkpoint_of_the_earlier_flat_format_is_named_as_such(tmp_path: Path) -> None:
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save

    from ringtree.train import sharded_checkpoint
    from ringtree.train.checkpoint import CheckpointError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save({"param/0.weight/0": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointError, match="written by an earlier ringtree"):
        sharded_checkpoint.tensors(tmp_path)
