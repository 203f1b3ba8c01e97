"""The pipeline runtime across processes: same parameters as the unpartitioned model, stashing, failures.

One spawned world of 4 ranks runs every case: 4 stages, then 2 pipelines of 2 stages (DP 2 x PP 2 via
the trainer), then a stage that fails (last, since the world stops there).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree.comm.errors import CollectiveError
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import PipelineStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build
from ringtree.schedules.pipeline_verify import peak_versions
from ringtree.train import TrainConfig, Trainer

P, M, STEPS, LR = 4, 4, 2, 0.1


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(n, 16), nn.Tanh()) for n in (8, 16, 16)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))  # 4 layers with parameters: one per stage


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(14, 8, generator=g), torch.randint(
        0, 4, (14,), generator=g
    )  # 14: unequal micro-batches


def _reference() -> list[torch.Tensor]:
    """The unpartitioned model trained STEPS times on the full batch."""
    net, (x, y) = _net(), _data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def _pipelined(rank: int, name: str) -> dict[str, Any]:
    stage = partition(_net(), P, by="params")[rank]
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    x, y = _data()
    micro = list(zip(x.tensor_split(M), y.tensor_split(M), strict=True))
    runner = PipelineStage(stage, rank, list(range(P)), timeout_s=30)
    for _ in range(STEPS):
        opt.zero_grad()
        run = runner.run(build(name, P, M), micro, step=opt.step)
    params = [p.detach() for p in stage.parameters()]
    return {"params": params, "activations": run.peak_activation_bytes, "versions": run.peak_versions}


def _failing(rank: int) -> str:
    stage = partition(_net(), P)[rank]
    if rank == 2:
        stage.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("stage 2 broke")))
    x, y = _data()
    start = time.monotonic()
    try:
        PipelineStage(stage, rank, list(range(P)), timeout_s=30).run(build("1f1b", P, M), [(x, y)] * M)
    except (CollectiveError, RuntimeError) as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    return "no error"


def _world(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {n: _pipelined(rank, n) for n in ("gpipe", "1f1b", "pipedream", "pipedream-vs")}
    cfg = TrainConfig(
        model="mlp", pp=2, micro_batches=4, batch_size=8, schedule="gpipe", epochs=3, progress=False
    )
    out["dp2xpp2"] = Trainer.from_config(cfg).fit()
    dist.barrier()
    out["failure"] = _failing(rank)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(_world, P, timeout_s=240, collective_timeout_s=60)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_schedules_give_the_unpartitioned_parameters(
    world: list[dict[str, Any]], name: str
) -> None:
    got = [p for rank in world for p in rank[name]["params"]]
    expected = _reference()
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_1f1b_keeps_fewer_activations_than_gpipe_on_later_stages(world: list[dict[str, Any]]) -> None:
    gpipe = [r["gpipe"]["activations"] for r in world]
    one = [r["1f1b"]["activations"] for r in world]
    assert one[0] == gpipe[0]  # with m = p stage 0 holds all m micro-batches in both
    assert one[-1] < gpipe[-1] / 2  # the last stage holds 1 micro-batch, not 4
    assert all(a <= b for a, b in zip(one, gpipe, strict=True))


@pytest.mark.parametrize("name", ["pipedream", "pipedream-vs"])
def test_pipedream_holds_the_weight_versions_its_schedule_says(
    world: list[dict[str, Any]], name: str
) -> None:
    schedule = build(name, P, M)
    assert [r[name]["versions"] for r in world] == [peak_versions(schedule, j) for j in range(P)]
    assert all(r[name]["versions"] <= P - j + 1 for j, r in enumerate(world))  # bounded by p - j + 1
    moved = [
        not torch.equal(a, b) for r in world for a, b in zip(r[name]["params"], _reference(), strict=False)
    ]
    assert any(moved)  # pipedream stepped (after every micro-batch), not the full-batch step


def test_dp_times_pp_trains_the_digits(world: list[dict[str, Any]]) -> None:
    s = world[0]["dp2xpp2"]
    assert (s["dp"], s["pp"], s["schedule"], s["world_size"]) == (2, 2, "gpipe", 4)
    assert s["accuracy"] >= 0.9, s
    assert s["theoretical_bubble_fraction"] == pytest.approx(1 / 5)
    assert 0.0 < s["bubble_fraction"] < 1.0
    assert all(r["dp2xpp2"]["accuracy"] == s["accuracy"] for r in world)  # replicas stayed identical


def test_a_failed_stage_raises_on_every_stage_quickly(world: list[dict[str, Any]]) -> None:
    messages = [r["failure"] for r in world]
    assert "stage 2 broke" in messages[2]
    for j in (0, 1, 3):
        assert messages[j].startswith("CollectiveError"), messages
        assert "stage 2 (rank 2) failed" in messages[j]
        assert float(messages[j].split(" after ")[1].split("s")[0]) < 10  # the abort, not the 30 s timeout
