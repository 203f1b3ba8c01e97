"""ringtree's DistributedDataParallel against single-process training and torch's own DDP.

One spawned world per world size runs every case and returns plain tensors; the tests compare
them here. Cases: every algorithm (bitwise equal replicas, allclose to one process on the
concatenated batch), torch's DDP, compression, no_sync accumulation, unused parameters, the
master-rank dp mode and overlap switched off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.parallel import DistributedDataParallel, MasterDataParallel
from ringtree.processes import spawn

STEPS = 3  # optimizer steps per case
B = 4  # samples per rank per step
BUCKET_MB = 500 / (1 << 20)  # 500 bytes: the test model splits into several buckets
Result = dict[str, Any]


class Net(nn.Module):
    """Three linear layers and an optional second head that only some ranks may use."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 5)
        self.extra = nn.Linear(32, 5) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.body(x)
        if use_extra:
            assert self.extra is not None
            return self.head(h) + self.extra(h)
        return self.head(h)


def data(p: int, steps: int = STEPS, b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batches: inputs [steps, p*b, 12] and targets [steps, p*b, 5]; rank r owns rows r*b:(r+1)*b."""
    g = torch.Generator().manual_seed(123)
    return torch.randn(steps, p * b, 12, generator=g), torch.randn(steps, p * b, 5, generator=g)


def make_net(seed: int, extra: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(extra)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1).clone() for q in module.parameters()])


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def train(
    model: nn.Module,
    inner: nn.Module,
    rank: int,
    p: int,
    extra_on: set[int] | None = None,
    set_to_none: bool = True,
) -> torch.Tensor:
    """STEPS steps of SGD with momentum on this rank's share; the flat parameters afterwards."""
    xs, ys = data(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(STEPS):
        rows = slice(rank * B, (rank + 1) * B)
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(model(xs[k, rows], use_extra=rank in (extra_on or ())), ys[k, rows]).backward()
        if isinstance(model, MasterDataParallel):
            model.step(opt)
        else:
            opt.step()
    return flat(inner)


def reference(p: int, extra_on: set[int] | None = None, steps: int = STEPS) -> torch.Tensor:
    """Single-process training on the concatenated batch (per-rank losses averaged)."""
    extra_on = extra_on or set()
    net = make_net(0, extra=bool(extra_on))
    xs, ys = data(p)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for k in range(steps):
        opt.zero_grad()
        losses = [
            loss_of(net(xs[k, r * B : (r + 1) * B], use_extra=r in extra_on), ys[k, r * B : (r + 1) * B])
            for r in range(p)
        ]
        (sum(losses) / p).backward()  # type: ignore[operator]
        opt.step()
    return flat(net)


def ddp(rank: int, extra: bool = False, **kw: Any) -> tuple[DistributedDataParallel, Net]:
    net = make_net(rank, extra)  # different on every rank: construction must broadcast rank 0's
    return DistributedDataParallel(net, bucket_cap_mb=BUCKET_MB, **kw), net


def case_algorithm(rank: int, p: int, algorithm: str) -> Result:
    model, net = ddp(rank, algorithm=algorithm)
    params = train(model, net, rank, p)
    return {"params": params, "buckets": len(model.buckets), "spans": len(model.last_sync.spans)}


def case_torch_ddp(rank: int, p: int) -> Result:
    net = make_net(rank)
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=BUCKET_MB)
    return {"params": train(model, net, rank, p)}


def case_compression(rank: int, p: int, compression: str) -> Result:
    model, net = ddp(rank, compression=compression)
    return {"params": train(model, net, rank, p)}


def case_no_sync(rank: int, p: int) -> Result:
    """K=3 micro-batches, the first two under no_sync(), against one 3x larger batch."""
    micro, big = ddp(rank, algorithm="ring")
    once, single = ddp(rank, algorithm="ring")
    xs, ys = data(p, steps=1, b=3 * B)
    x, y = xs[0, rank * 3 * B : (rank + 1) * 3 * B], ys[0, rank * 3 * B : (rank + 1) * 3 * B]
    for i in range(3):
        part = slice(i * B, (i + 1) * B)
        if i < 2:
            with micro.no_sync():
                (loss_of(micro(x[part]), y[part]) / 3).backward()
        else:
            (loss_of(micro(x[part]), y[part]) / 3).backward()
    loss_of(once(x), y).backward()
    grads = [
        torch.cat([q.grad.reshape(-1) for q in m.parameters() if q.grad is not None]) for m in (big, single)
    ]
    return {"micro": grads[0], "large": grads[1], "after_first": bool(micro.last_sync.spans)}


def case_unused_error(rank: int, p: int) -> Result:
    model, _ = ddp(rank, extra=True, algorithm="ring")
    x = torch.randn(B, 12)
    try:
        model(x).sum().backward()
    except Exception as e:  # the test inspects the type and message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def case_unused(rank: int, p: int) -> Result:
    """find_unused_parameters=True; `extra` used on rank 0 only (p > 1) or by no rank."""
    model, net = ddp(rank, extra=True, algorithm="tree", find_unused_parameters=True)
    some = train(model, net, rank, p, extra_on={0})
    model, net = ddp(rank, extra=True, algorithm="tree", find_unused_parameters=True)
    none = train(model, net, rank, p)
    assert net.extra is not None
    return {
        "some": some,
        "none": none[: -net.extra.weight.numel() - 5],
        "extra_grad_is_none": net.extra.weight.grad is None,
    }


def case_bucket_views(rank: int, p: int) -> Result:
    """Gradients zeroed in place (so autograd accumulates straight into the buckets)."""
    model, net = ddp(rank, algorithm="ring")
    params = train(model, net, rank, p, set_to_none=False)
    views = [b.holds(i, q.grad) for b in model.buckets for i, q in enumerate(b.params)]
    storage = {b.buffer.untyped_storage().data_ptr() for b in model.buckets}
    grads = {q.grad.untyped_storage().data_ptr() for q in net.parameters() if q.grad is not None}
    return {"params": params, "all_views": all(views) and grads <= storage}


def case_dp(rank: int, p: int) -> Result:
    net = make_net(rank)
    return {"params": train(MasterDataParallel(net), net, rank, p)}


def case_no_overlap(rank: int, p: int) -> Result:
    model, net = ddp(rank, algorithm="ring", overlap=False)
    return {"params": train(model, net, rank, p)}


def case_last_bucket(rank: int, p: int) -> Result:
    """Which buckets each backward hands to the comm thread and which it keeps (deferred)."""
    model, net = ddp(rank, algorithm="ring")
    launched: list[tuple[int, bool]] = []
    real = model._launcher.launch

    def launch(bucket: int, tensor: torch.Tensor, validate: bool, defer: bool = False) -> None:
        launched.append((bucket, defer))
        real(bucket, tensor, validate, defer)

    model._launcher.launch = launch  # type: ignore[method-assign]
    params = train(model, net, rank, p)
    return {"params": params, "launched": launched, "buckets": len(model.buckets)}


def world(rank: int, p: int, full: bool) -> dict[str, Result]:
    """Every case of a world, in the same order on every rank."""
    out = {f"algo:{a}": case_algorithm(rank, p, a) for a in comm.algorithms()}
    out["dp"] = case_dp(rank, p)
    if full:
        out["torch"] = case_torch_ddp(rank, p)
        out["fp16"] = case_compression(rank, p, "fp16")
        out["bf16"] = case_compression(rank, p, "bf16")
        out["no_sync"] = case_no_sync(rank, p)
        out["unused_error"] = case_unused_error(rank, p)
        out["unused"] = case_unused(rank, p)
        out["no_overlap"] = case_no_overlap(rank, p)
        out["views"] = case_bucket_views(rank, p)
        out["last_bucket"] = case_last_bucket(rank, p)
    dist.barrier()
    return out


_WORLDS: dict[int, list[dict[str, Result]]] = {}


def results(p: int) -> list[dict[str, Result]]:
    """Each rank's results in a world of p ranks (4 ranks pretend to be 2 nodes of 2), spawned once."""
    if p not in _WORLDS:
        local = 2 if p == 4 else None
        _WORLDS[p] = spawn(world, p, (p, p == 2), timeout_s=120, local_world_size=local)
    return _WORLDS[p]


def assert_replicas_equal(per_rank: list[torch.Tensor]) -> None:
    for r, params in enumerate(per_rank[1:], start=1):
        assert torch.equal(params, per_rank[0]), f"rank {r}'s parameters differ from rank 0's"


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algorithm", comm.algorithms())
def test_every_algorithm_matches_single_process(p: int, algorithm: str) -> None:
    got = [r[f"algo:{algorithm}"] for r in results(p)]
    assert_replicas_equal([g["params"] for g in got])
    torch.testing.assert_close(got[0]["params"], reference(p), rtol=1e-5, atol=1e-6)
    assert got[0]["buckets"] >= 3 and got[0]["spans"] == got[0]["buckets"]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_master_rank_dp_matches_single_process(p: int) -> None:
    got = [r["dp"]["params"] for r in results(p)]
    assert_replicas_equal(got)
    torch.testing.assert_close(got[0], reference(p), rtol=1e-5, atol=1e-6)


def test_matches_torch_ddp() -> None:
    ours, theirs = results(2)[0]["algo:native"]["params"], results(2)[0]["torch"]["params"]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_close_to_fp32(compression: str) -> None:
    got = [r[compression]["params"] for r in results(2)]
    assert_replicas_equal(got)
    tol = {"fp16": 2e-3, "bf16": 2e-2}[compression]
    torch.testing.assert_close(got[0], reference(2), rtol=tol, atol=tol)
    assert not torch.equal(got[0], results(2)[0]["algo:ring"]["params"]), "compression had no effect"


def test_no_sync_accumulation_equals_larger_batch() -> None:
    for r in results(2):
        torch.testing.assert_close(r["no_sync"]["micro"], r["no_sync"]["large"], rtol=1e-5, atol=1e-7)
        assert r["no_sync"]["after_first"]


def test_unused_parameter_is_named() -> None:
    for r in results(2):
        assert r["unused_error"]["type"] in ("ValueError", "RuntimeError")
        assert "extra.weight" in r["unused_error"]["message"]
        assert "find_unused_parameters=True" in r["unused_error"]["message"]


def test_find_unused_parameters() -> None:
    got = [r["unused"] for r in results(2)]
    assert_replicas_equal([g["some"] for g in got])
    torch.testing.assert_close(got[0]["some"], reference(2, extra_on={0}), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0]["none"], reference(2), rtol=1e-5, atol=1e-6)
    assert all(g["extra_grad_is_none"] for g in got), "a parameter no rank used must keep grad None"


def test_without_overlap_same_result() -> None:
    got = [r["no_overlap"]["params"] for r in results(2)]
    assert_replicas_equal(got)
    assert torch.equal(got[0], results(2)[0]["algo:ring"]["params"])


def test_gradients_are_bucket_views_and_accumulate_in_place() -> None:
    got = [r["views"] for r in results(2)]
    assert all(g["all_views"] for g in got), "every .grad must be its slice of a bucket after backward"
    assert_replicas_equal([g["params"] for g in got])
    assert torch.equal(got[0]["params"], results(2)[0]["algo:ring"]["params"])


def test_the_last_bucket_runs_on_backward_s_own_thread() -> None:
    """The bucket that completes backward's gradients is kept for the end-of-backward callback
    (no hand-off to the comm thread and back); the others overlap backward on the comm thread."""
    for r in results(2):
        got, n = r["last_bucket"], r["last_bucket"]["buckets"]
        assert n >= 3 and len(got["launched"]) == n * STEPS
        assert got["launched"] == [(j, j == n - 1) for j in range(n)] * STEPS
        assert torch.equal(got["params"], results(2)[0]["algo:ring"]["params"])
