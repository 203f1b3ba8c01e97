"""The trainer's --zero: ZeRO 1/2/3 end with --zero 0's parameters under DP 2 x PP 2 (1F1B and
GPipe with accumulation), and the summary shows model_state_mb and peak_memory_mb."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.launch import spawn
from ringtree.train import TrainConfig, Trainer

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
