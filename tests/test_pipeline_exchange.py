"""The pipeline's transfers (receives posted early, shapes remembered between runs; or the
shared-memory mailbox between stages of one host) keep the gradients exact.

One spawned world of 3 stages runs gpipe and 1f1b several times in a row with a user's loss
(MSE on a regression target): the same micro-batch sizes twice (the second run receives into
buffers posted at its start), then different sizes (the sender fills the receive posted for the
old shape and sends again), then fewer micro-batches. Every run's gradients and losses must equal
the unpipelined model's on the same data. Last, stage 1 fails in a 1f1b run right after sending a
gradient whose shape changed (its data still in flight): the abort must reach both other stages.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree.comm import mailbox
from ringtree.comm.errors import CollectiveError
from ringtree.comm.shm import TRANSPORT_ENV
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import PipelineStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build

P = 3
SIZES = ([4, 4, 4, 4], [4, 4, 4, 4], [5, 3, 4, 2], [6, 8])  # micro-batch sizes of successive runs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def _batches(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g)) for b in sizes]


def _reference(sizes: list[int], seed: int) -> tuple[list[torch.Tensor], list[float]]:
    """Gradients of the unpipelined net on the whole batch, and each micro-batch's loss."""
    net, batches = _net(), _batches(sizes, seed)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    F.mse_loss(net(x), y).backward()
    with torch.no_grad():
        losses = [float(F.mse_loss(net(bx), by)) for bx, by in batches]
    return [p.grad.clone() for p in net.parameters() if p.grad is not None], losses


def _stage(rank: int, transport: str) -> dict[str, Any]:
    os.environ[TRANSPORT_ENV] = "p2p" if transport == "p2p" else "shm"
    if transport == "mixed":  # stage 2 on another host: 0-1 through the mailbox, 1-2 through gloo
        real = mailbox.host_key()
        mailbox.host_key = lambda: [*(real or []), "B" if rank == 2 else "A"]  # type: ignore[assignment]
    stage = partition(_net(), P, by="params")[rank]
    runner = PipelineStage(stage, rank, list(range(P)), timeout_s=30, loss_fn=F.mse_loss)
    out: dict[str, Any] = {}
    for name in ("gpipe", "1f1b"):
        for k, sizes in enumerate(SIZES):
            stage.zero_grad(set_to_none=True)
            run = runner.run(build(name, P, len(sizes)), _batches(sizes, seed=k))
            grads = [p.grad.clone() for p in stage.parameters() if p.grad is not None]
            out[f"{name}-{k}"] = {"grads": grads, "losses": run.losses}
    out["mailbox"] = sorted(runner.exchange.boxed)
    out["failure"] = _fail_in_a_later_run(stage, runner, rank)
    return out


def _fail_in_a_later_run(stage: nn.Module, runner: PipelineStage, rank: int) -> str:
    """Stage 1 raises in the forward of micro-batch 2 (after the backward of 0) of a 1f1b run."""
    calls = 0

    def hook(*_: Any) -> None:
        nonlocal calls
        calls += 1
        if rank == 1 and calls == 3:
            raise RuntimeError("stage 1 broke")

    stage.register_forward_hook(hook)
    start = time.monotonic()
    try:
        runner.run(build("1f1b", P, 4), _batches([4, 4, 4, 4], seed=0))
    except (CollectiveError, RuntimeError) as e:
        message = f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    else:
        message = "no error"
    dist.barrier()  # no stage exits (closing its connections) before every abort was read
    return message


BOXED = {"shm": [[1], [0, 2], [1]], "p2p": [[], [], []], "mixed": [[1], [0], []]}


@pytest.fixture(scope="module", params=list(BOXED))
def world(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Stages of one host talk through the shared-memory mailbox, others (or all, with p2p) through gloo."""
    results = spawn(_stage, P, (request.param,), timeout_s=120, collective_timeout_s=60)
    assert [rank["mailbox"] for rank in results] == BOXED[request.param]
    return results


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", range(len(SIZES)))
def test_every_run_gives_the_unpipelined_gradients_and_losses(
    world: list[dict[str, Any]], name: str, k: int
) -> None:
    expected, losses = _reference(SIZES[k], seed=k)
    got = [g for rank in world for g in rank[f"{name}-{k}"]["grads"]]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert world[-1][f"{name}-{k}"]["losses"] == pytest.approx(losses, rel=1e-5)
    assert all(rank[f"{name}-{k}"]["losses"] == [] for rank in world[:-1])  # only the last stage has a loss


def test_a_failure_in_a_later_run_reaches_every_stage(world: list[dict[str, Any]]) -> None:
    messages = [rank["failure"] for rank in world]
    assert "stage 1 broke" in messages[1]
    for j in (0, 2):
        assert messages[j].startswith("CollectiveError"), messages
        assert "stage 1 (rank 1) failed" in messages[j]
        assert float(messages[j].split(" after ")[1].split("s")[0]) < 10  # the abort, not the 30 s timeout
