"""Faults under ZeRO: a gradient overflow on one rank's shard skips the step on every rank (fp16's
loss scaling, and training goes on to converge); a rank that stops inside a reduce-scatter or an
all-gather is named by the flight recorder on the ranks left waiting."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree.comm import flight_recorder
from ringtree.parallel import ShardedDataParallel
from ringtree.parallel.shards import local
from ringtree.processes import spawn
from ringtree.train.techniques.amp import MixedPrecision


def fp16_scaling() -> MixedPrecision:
    """MixedPrecision's fp16 path (GradScaler) on the CPU, where `--amp fp16` itself is refused."""
    amp = MixedPrecision("off")
    amp.mode, amp.scaler = "fp16", torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return amp


def agree(ok: bool) -> bool:
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def overflow(rank: int, zero: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ShardedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)), zero=zero)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    amp = fp16_scaling()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 6, generator=g)
    y = x.sum(1, keepdim=True)
    losses, applied = [], []
    for step in range(25):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        amp.backward(loss)
        if step == 1 and rank == 1:  # one rank's shard overflows
            shard = next(p for p in model.parameters() if p.grad is not None)
            local(shard.grad)[0] = float("inf")  # type: ignore[index]
        before = [local(p).detach().clone() for p in model.parameters()]
        applied.append(amp.step(opt, agree))
        if step == 1:
            unchanged = all(torch.equal(b, local(p)) for b, p in zip(before, model.parameters(), strict=True))
        losses.append(float(loss))
    assert amp.scaler is not None
    return {"applied": applied, "unchanged": unchanged, "losses": losses, "skipped": amp.skipped_steps}


def overflows(rank: int) -> dict[int, dict[str, Any]]:
    return {zero: overflow(rank, zero) for zero in (1, 2, 3)}


def test_an_overflow_in_one_ranks_shard_skips_the_step_everywhere() -> None:
    for r in (by_zero[z] for by_zero in spawn(overflows, 2, timeout_s=90) for z in (1, 2, 3)):
        assert r["applied"][1] is False and r["unchanged"] and r["skipped"] == 1
        assert all(r["applied"][:1] + r["applied"][2:])
        assert r["losses"][-1] < 0.2 * r["losses"][0]  # and training still converges


def stops_in(rank: int, folder: str, zero: int) -> str:
    """One step everywhere; then rank 2 stops training and the others go on into a collective."""
    os.environ[flight_recorder.DUMP_DIR_ENV] = folder
    torch.manual_seed(0)
    model = ShardedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), zero=zero, timeout_s=1.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    if zero == 3:
        opt.step()  # zero 3: the next forward all-gathers; zero 2: the next backward reduce-scatters
    if rank == 2:
        time.sleep(4)
        return "stopped"
    try:
        model(torch.ones(2, 4)).sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(("zero", "collective"), [(2, "reduce_scatter"), (3, "all_gather")])
def test_the_flight_recorder_names_the_rank_that_stopped_inside_zero(
    tmp_path: Any, zero: int, collective: str
) -> None:
    for message in spawn(stops_in, 3, (str(tmp_path), zero), timeout_s=90)[:2]:
        assert message.startswith("CollectiveError"), message
        assert "Culprit: rank 2" in message and collective in message, message
