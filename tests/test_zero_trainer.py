"""The trainer's --zero: ZeRO 1/2/3 end with --zero 0's parameters under DP 2 x PP 2 (1F1B and
GPipe with accumulation), the summary shows model_state_mb and peak_memory_mb; a sharded
checkpoint keeps --amp fp16's loss scale."""

from __future__ import annotations

import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from ringtree.train import trainer as trainer_module
from ringtree.train.techniques import MixedPrecision

BASE = TrainConfig(epochs=1, batch_size=8, lr=1e-2, progress=False, pp=2, micro_batches=2, bucket_mb=0.0005)


def _regression(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def _regressor() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _runs(rank: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for schedule, accumulate in (("1f1b", 1), ("gpipe", 2)):
        for zero in (0, 1, 2, 3):
            cfg = replace(BASE, zero=zero, schedule=schedule, accumulate=accumulate)
            trainer = Trainer(_regressor(), _regression(), nn.MSELoss(), cfg)
            summary = trainer.fit()
            params = torch.cat([p.detach().reshape(-1) for p in trainer.net.parameters()])
            out[(schedule, zero)] = {"params": params, "summary": summary}
    return out


def test_zero_under_dp_2_x_pp_2_ends_with_zero_0s_parameters() -> None:
    results = spawn(_runs, 4, timeout_s=300)
    for r in results:
        for schedule in ("1f1b", "gpipe"):
            ddp = r[(schedule, 0)]
            assert (ddp["summary"]["dp"], ddp["summary"]["pp"]) == (2, 2)
            assert not torch.equal(
                ddp["params"], torch.cat([p.detach().reshape(-1) for p in _regressor().parameters()])
            )
            for zero in (1, 2, 3):
                got = r[(schedule, zero)]
                assert got["summary"]["zero"] == zero
                assert (got["params"] - ddp["params"]).abs().max().item() <= 1e-5, (schedule, zero)
    s0, s3 = results[0][("1f1b", 0)]["summary"], results[0][("1f1b", 3)]["summary"]
    assert s3["model_state_mb"] < 0.6 * s0["model_state_mb"]  # DP 2: about half (padding, tiny model)
    assert s0["peak_memory_mb"] > 10  # a process's peak RSS, in MiB


def _save_at_4(rank: int, ck: str) -> None:
    plain = replace(BASE, pp=1, micro_batches=None, epochs=1, checkpoint_dir=f"{ck}/dense")
    Trainer(_regressor(), _regression(), nn.MSELoss(), plain).fit()  # today's dense checkpoints
    Trainer(
        _regressor(), _regression(), nn.MSELoss(), replace(plain, zero=3, checkpoint_dir=f"{ck}/z3")
    ).fit()


def _resume_at_2(rank: int, ck: str) -> dict[str, Any]:
    again = replace(BASE, pp=1, micro_batches=None, epochs=2)
    out = {}
    for name, folder, zero in (("dense_to_z2", "dense", 2), ("z3_to_z2", "z3", 2), ("z3_to_z0", "z3", 0)):
        cfg = replace(again, zero=zero, checkpoint_dir=f"{ck}/{folder}-{name}", resume=True)
        out[name] = Trainer(_regressor(), _regression(), nn.MSELoss(), cfg).fit()
    return out


def test_saved_at_4_ranks_resumes_at_2_dense_or_sharded(tmp_path: Path) -> None:
    spawn(_save_at_4, 4, (str(tmp_path),), timeout_s=180)
    for name, folder in (("dense_to_z2", "dense"), ("z3_to_z2", "z3"), ("z3_to_z0", "z3")):
        shutil.copytree(tmp_path / folder, tmp_path / f"{folder}-{name}")  # each resume writes its own
    assert any((tmp_path / "z3").glob("step-*.dcp")) and any((tmp_path / "dense").glob("step-*.pt"))
    results = spawn(_resume_at_2, 2, (str(tmp_path),), timeout_s=180)
    for name in ("dense_to_z2", "z3_to_z2", "z3_to_z0"):
        s = results[0][name]
        assert s["dp"] == 2 and s["resumed_from_step"] == 3, (name, s["resumed_from_step"])  # 96 / (4 x 8)
        assert s["steps"] == 12 and s["final_loss"] < 10  # 2 epochs of 96 / (2 x 8), the first 3 done


class _CpuLossScaling(MixedPrecision):
    """--amp fp16's loss scaling with torch's CPU GradScaler (fp16 itself needs CUDA), autocast off;
    its scale doubles every step, so that a scale restarted by a resume shows."""

    made: ClassVar[list[_CpuLossScaling]] = []

    def __init__(self, mode: str, device_type: str = "cpu") -> None:
        super().__init__("off", device_type)
        self.mode = "fp16"
        self.scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        self.made.append(self)

    def autocast(self) -> AbstractContextManager[object]:
        return nullcontext()


def test_a_sharded_checkpoint_keeps_the_fp16_loss_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO 1, 2 epochs of 4 steps saved after each; resumed from step 4 at --zero 1 and --zero 0."""
    monkeypatch.setattr(trainer_module, "MixedPrecision", _CpuLossScaling)
    cfg = replace(BASE, pp=1, micro_batches=None, batch_size=24, epochs=2, zero=1)

    def fit(folder: str, **changes: Any) -> tuple[dict[str, Any], float]:
        run = replace(cfg, checkpoint_dir=str(tmp_path / folder), **changes)
        summary = Trainer(_regressor(), _regression(), nn.MSELoss(), run).fit()
        return summary, _CpuLossScaling.made[-1].scaler.get_scale()  # type: ignore[union-attr]

    whole, scale = fit("whole")
    assert whole["steps"] == 8 and scale == 8.0 * 2**8  # no step overflowed
    for zero in (1, 0):
        shutil.copytree(tmp_path / "whole", tmp_path / f"z{zero}")
        shutil.rmtree(tmp_path / f"z{zero}" / "step-00000008.dcp")
        resumed, resumed_scale = fit(f"z{zero}", zero=zero, resume=True)
        assert resumed["resumed_from_step"] == 4 and resumed_scale == scale, zero
        assert resumed["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-6), zero
