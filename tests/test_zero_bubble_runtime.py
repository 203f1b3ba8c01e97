"""The zero-bubble schedules in the runtime: B and W as two actions, the V placement, against 1F1B."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.parallel.pipeline.runtime import PipelineStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build
from tests.benchmark_scripts import load


def _layers(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(n)))


def _batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 6, generator=g), torch.randint(0, 6, (3,), generator=g)) for _ in range(m)]


def _run(rank: int, p: int, m: int, name: str) -> dict[str, Any]:
    """Two runs of `name` on 2p layers (one a chunk for the V, two a stage otherwise)."""
    schedule = build(name, p, m, 2 if name in ("zb-v", "dualpipev") else 1)
    model = _layers(2 * p)
    runner: PipelineStage | InterleavedStage
    if schedule.placement == "v":
        chunks = [model[schedule.virtual_of(rank, c)] for c in range(2)]
        runner = InterleavedStage(chunks, rank, list(range(p)), timeout_s=30, placement="v")
    else:
        runner = PipelineStage(model[2 * rank : 2 * rank + 2], rank, list(range(p)), timeout_s=30)
    batches, out = _batches(m), {}
    for run in range(2):  # the second run posts its receives early (shapes known)
        model.zero_grad()
        result = runner.run(schedule, batches)
        out[f"losses{run}"] = result.losses
        out["kinds"] = sorted({s.kind for s in result.spans})
    out["grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out


def _reference(p: int, m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _layers(2 * p), _batches(m)
    total = sum(len(y) for _, y in batches)
    for x, y in batches:
        (F.cross_entropy(model(x), y) * len(y) / total).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(x), y)) for x, y in batches]
    return losses, {n: q.grad for n, q in model.named_parameters() if q.grad is not None}


@pytest.mark.parametrize(
    ("p", "m", "name"),
    [
        (2, 4, "1f1b"),
        (2, 4, "zb-h1"),
        (2, 4, "zb-h2"),
        (2, 4, "zb-v"),
        (2, 5, "dualpipev"),
        pytest.param(4, 8, "zb-v", marks=pytest.mark.slow),
    ],
)
def test_each_schedule_gives_the_plain_models_losses_and_gradients(p: int, m: int, name: str) -> None:
    results = spawn(_run, p, (p, m, name), timeout_s=90)
    losses, grads = _reference(p, m)
    last = next(r for r in results if r["losses0"])  # the rank of the last virtual stage: rank 0 in a V
    assert last["losses0"] == pytest.approx(losses, rel=1e-6) and last["losses1"] == last["losses0"]
    seen: set[str] = set()
    for r in results:
        if name != "1f1b":
            assert "weight" in r["kinds"], "W ran as its own action"
        seen |= set(r["grads"])
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, grads[n], rtol=1e-6, atol=1e-7, msg=n)
    assert seen == set(grads)


def _against_torch(rank: int) -> dict[str, Any]:
    worker = load("pipeline_zero_bubble").worker  # loaded in the worker: a script is no module
    return worker(rank, 4, 2, 1)  # type: ignore[no-any-return]


def test_losses_and_gradients_equal_torchs_own_zero_bubble_schedules() -> None:
    rows = spawn(_against_torch, 2, timeout_s=120)[0]["rows"]
    assert [(r["schedule"], r["torch_schedule"]) for r in rows] == [
        ("zb-v", "ScheduleZBVZeroBubble"),
        ("zb-h1", "ScheduleInterleavedZeroBubble"),
    ]
    for r in rows:
        assert len(r["ringtree_losses"]) == len(r["torch_losses"]) == 4
        assert r["max_loss_difference"] <= 1e-6 and r["max_relative_grad_difference"] <= 1e-6, r
