"""--checkpoint-async: the saves of a run that goes on while they are written equal a synchronous
run's; the summary says how long the loop waited per save; a crash while an asynchronous save is
being written leaves the previous checkpoint the newest usable one. A world of one process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.train import TrainConfig, Trainer, sharded_checkpoint
from ringtree.train.checkpointer import consolidate

BASE = TrainConfig(epochs=1, batch_size=8, lr=1e-2, progress=False, checkpoint_every=2, bucket_mb=0.0005)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def fit(cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    summary = Trainer(net, data(), nn.MSELoss(), cfg).fit()
    return summary, {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("zero", [0, 3])
def test_asynchronous_saves_hold_what_synchronous_ones_do(tmp_path: Path, zero: int) -> None:
    sync, _ = fit(replace(BASE, zero=zero, checkpoint_dir=str(tmp_path / "sync")))
    asyn, _ = fit(replace(BASE, zero=zero, checkpoint_dir=str(tmp_path / "async"), checkpoint_async=True))
    assert sync["checkpoint_s"] > 0 and asyn["checkpoint_s"] > 0 and asyn["checkpoint_async"] is True
    a, b = (
        consolidate(tmp_path / "sync", tmp_path / "a.pt"),
        consolidate(tmp_path / "async", tmp_path / "b.pt"),
    )
    saved_sync, saved_async = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    for name, value in saved_sync.items():
        assert torch.equal(saved_async[name], value), name


def test_a_crash_during_an_asynchronous_save_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seal = sharded_checkpoint._seal

    def dies_at_step_4(folder: Path, tmp: Path, final: Path, record: dict[str, Any], keep: int) -> None:
        if record["step"] >= 4:
            raise OSError("the process died while its checkpoint was being written")
        seal(folder, tmp, final, record, keep)

    monkeypatch.setattr(sharded_checkpoint, "_seal", dies_at_step_4)
    folder = tmp_path / "ck"
    with pytest.raises(OSError, match="died while"):
        fit(replace(BASE, zero=3, checkpoint_dir=str(folder), checkpoint_async=True))
    found = sharded_checkpoint.find(folder)
    assert found is not None and found[1]["step"] == 2
    assert (folder / ".step-00000004.dcp.tmp").is_dir()  # written, never sealed: not a checkpoint
