"""Shared-expert overlap: the dispatch and combine all-to-alls travel while the shared experts
compute. The same bits as the blocking exchanges (outputs and every gradient, EP 2, a background
thread and torch's asynchronous work); the accounting of `a2a_exposed_s` against a fake clock;
one exchange of a group at a time; a dead peer still named from an overlapped dispatch; the
trainer with --moe-shared-expert-overlap and without (the default), same losses, the waits
reported apart."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.parallel import ExpertParallel, MoE
from ringtree.parallel.moe import alltoall
from ringtree.processes import spawn
from ringtree.train.metrics import moe_metrics

DIM, HIDDEN, EXPERTS, TOKENS = 8, 16, 4, 12


class FakeClock:
    """Time that moves only when a test says so; counts its reads (thread-safe)."""

    def __init__(self) -> None:
        self.t, self.reads, self.lock = 0.0, 0, threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.reads += 1
            return self.t


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_exchange(monkeypatch: pytest.MonkeyPatch, body: Any) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(alltoall, "now", clock)
    monkeypatch.setattr(alltoall, "_run", lambda *args: body(clock))
    return clock


def _deltas(before: alltoall.Clock) -> tuple[float, float, int]:
    c = alltoall.CLOCK
    return c.seconds - before.seconds, c.exposed - before.exposed, c.calls - before.calls


def _snapshot() -> alltoall.Clock:
    c = alltoall.CLOCK
    return alltoall.Clock(c.seconds, c.exposed, c.cpu_seconds, c.calls, c.rows)


def test_a_wait_counts_only_while_the_exchange_outlasts_the_work_beside_it(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started at 0, the shared experts until 3, the exchange until 5: 5 s of all-to-all, 2 waited."""

    def exchange(clock: FakeClock) -> None:  # ends at 5, once the training thread began to wait
        deadline = time.monotonic() + 10
        while clock.reads < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        clock.t = 5.0

    clock = _fake_exchange(monkeypatch, exchange)
    rows = torch.randn(3, DIM)
    before = _snapshot()
    pending = alltoall.start(rows, [[3]], "pairwise", None)  # issued at 0 (read 1)
    clock.t = 3.0  # the shared experts took 3 s
    assert pending.wait() is pending.output  # the wait begins at 3 (read 2) and ends at 5
    assert _deltas(before) == (5.0, 2.0, 1)


def test_an_exchange_hidden_behind_the_work_costs_no_wait_and_a_blocking_one_all(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _fake_exchange(monkeypatch, lambda clock: None)
    rows = torch.randn(3, DIM)
    before = _snapshot()
    pending = alltoall.start(rows, [[3]], "pairwise", None)  # issued at 0, done at 0
    assert pending.future is not None
    concurrent.futures.wait([pending.future])
    clock.t = 3.0  # the shared experts outlasted it
    pending.wait()
    assert _deltas(before) == (0.0, 0.0, 1)

    def blocking(clock: FakeClock) -> None:
        clock.t += 2.0

    _fake_exchange(monkeypatch, blocking)
    before = _snapshot()
    alltoall.start(rows, [[3]], "pairwise", None, background=False).wait()  # overlap off: blocks 2 s
    assert _deltas(before) == (2.0, 2.0, 1)


def test_a_group_runs_one_exchange_at_a_time(world_of_one: None, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    _fake_exchange(monkeypatch, lambda clock: release.wait(10))
    rows = torch.randn(3, DIM)
    pending = alltoall.start(rows, [[3]], "pairwise", None)
    with pytest.raises(RuntimeError, match="still in flight"):
        alltoall.start(rows, [[3]], "pairwise", None)
    with pytest.raises(RuntimeError, match="still in flight"):
        alltoall.exchange_counts(torch.zeros(4), "pairwise", None)
    release.set()
    pending.wait()
    alltoall.start(rows, [[3]], "pairwise", None).wait()  # free again


def test_the_summary_takes_the_waits_apart_from_the_exchanges(world_of_one: None) -> None:
    parallel = ExpertParallel(1)
    parallel.apply(MoE(DIM, HIDDEN, EXPERTS, shared=1))
    steps = [(9.0, 9.0), (0.4, 0.1), (0.6, 0.3)]  # the first step (warm-up) is left out
    metrics = moe_metrics(parallel, steps)
    assert metrics["a2a_time_s"] == pytest.approx(0.5) and metrics["a2a_exposed_s"] == pytest.approx(0.2)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, shared=1), nn.Tanh(), MoE(DIM, HIDDEN, EXPERTS, top_k=2, shared=2)
    )


def _step(rank: int, algorithm: str, overlap: bool) -> dict[str, Any]:
    model = _model()
    ExpertParallel(2, algorithm=algorithm, overlap=overlap).apply(model)
    x = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(1))[rank].requires_grad_()
    before = _snapshot()
    out = model(x)
    (out**2).sum(-1).mean().backward()
    seconds, exposed, calls = _deltas(before)
    assert x.grad is not None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "out": out.detach(),
        "x": x.grad,
        "grads": grads,
        "seconds": seconds,
        "exposed": exposed,
        "calls": calls,
    }


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [k for k in ("out", "x") if not torch.equal(a[k], b[k])]
    bad += [n for n in a["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
    return bad + ([] if a["grads"].keys() == b["grads"].keys() else ["gradient names"])


def _overlap_world(rank: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for algorithm in ("linear", "native"):  # a background thread (shared memory); torch's async work
        blocking, overlapped = _step(rank, algorithm, False), _step(rank, algorithm, True)
        found[algorithm] = {
            "differ": _differences(blocking, overlapped),
            "params": len(overlapped["grads"]),
            "calls": (blocking["calls"], overlapped["calls"]),
            "blocking": (blocking["seconds"], blocking["exposed"]),
            "overlapped": (overlapped["seconds"], overlapped["exposed"]),
        }
    found["dead"] = _dead_peer(rank)
    return found


def _dead_peer(rank: int) -> str:
    """Rank 1 dies; rank 0's overlapped dispatch (the background thread, shared memory) names it."""
    os.environ["RINGTREE_TRANSPORT"] = "shm"
    rows, matrix = torch.arange(8.0).view(4, 2), [[2, 2], [2, 2]]
    alltoall.exchange_beside(rows, matrix, "linear", None, lambda: None)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        alltoall.exchange_beside(rows, matrix, "linear", None, lambda: time.sleep(0.05))
    except comm.CollectiveError as e:
        return f"{time.monotonic() - start:.1f} CollectiveError: {e}"
    return "no error"


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = spawn(_overlap_world, 2, timeout_s=120, allow_missing=True)
    assert results[0] is not None and results[1] is None  # rank 1 left in the dead-peer phase
    found: dict[str, Any] = results[0]
    return found


@pytest.mark.parametrize("algorithm", ["linear", "native"])
def test_overlap_gives_the_blocking_exchanges_bits_in_outputs_and_every_gradient(
    world: dict[str, Any], algorithm: str
) -> None:
    r = world[algorithm]
    assert r["differ"] == [] and r["params"] == 2 * 7  # router, 3 expert and 3 shared weights a layer
    assert r["calls"] == (10, 10)  # a layer: counts, dispatch, combine and their 2 backwards


@pytest.mark.parametrize("algorithm", ["linear", "native"])
def test_exposed_is_all_of_blocking_exchanges_and_less_once_the_shared_experts_overlap(
    world: dict[str, Any], algorithm: str
) -> None:
    seconds, exposed = world[algorithm]["blocking"]
    assert seconds > 0 and exposed == pytest.approx(seconds, rel=1e-9)
    seconds, exposed = world[algorithm]["overlapped"]
    assert 0 <= exposed < seconds  # each started exchange was issued before the shared experts ran


def test_a_dead_peer_is_named_from_an_overlapped_dispatch(world: dict[str, Any]) -> None:
    seconds, _, text = world["dead"].partition(" ")
    assert "CollectiveError" in text and "rank 1" in text, text
    assert float(seconds) < 30, world["dead"]


def _trainer_world(rank: int) -> list[dict[str, Any]]:
    from ringtree.train import TrainConfig, Trainer

    small = {"model": "moe", "dataset": "tests.moe_data:small", "epochs": 1, "progress": False}
    small |= {"straggler_every": 0, "ep": 2, "shared_experts": 1, "batch_size": 32}
    on, default = TrainConfig(**small, moe_shared_expert_overlap=True), TrainConfig(**small)
    return [Trainer.from_config(cfg).fit() for cfg in (on, default)]


def test_the_trainer_overlaps_when_asked_and_reports_the_waits_apart() -> None:
    on, off = spawn(_trainer_world, 2, timeout_s=120)[0]
    assert on["moe_shared_expert_overlap"] is True and off["moe_shared_expert_overlap"] is False
    assert (on["final_loss"], on["test_loss"]) == (off["final_loss"], off["test_loss"])  # the same bits
    assert 0 <= on["a2a_exposed_s"] < on["a2a_time_s"]
    assert off["a2a_time_s"] > 0 and off["a2a_exposed_s"] == pytest.approx(off["a2a_time_s"], rel=1e-9)
