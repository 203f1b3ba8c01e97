"""ShardedDataParallel (ZeRO 1/2/3) against ringtree's DDP and torch's FSDP2 on the same model.

One spawned world per world size runs the cases and returns plain tensors; the tests compare
them here: the same final parameters as DDP (<= 1e-5 in fp32) with and without accumulation, the
same loss curve as torch.distributed.fsdp.fully_shard, shards of 1/p, refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ringtree.parallel import DistributedDataParallel, ShardedDataParallel
from ringtree.parallel.shards import local
from ringtree.processes import spawn

STEPS = 3
B = 4  # samples per rank per micro-batch
BUCKET_MB = 2000 / (1 << 20)  # about 2 kB: the model splits into several buckets


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 31), nn.ReLU(), nn.Linear(31, 5))


def data(p: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[STEPS, k micro-batches, p*B, ...]: rank r owns rows r*B:(r+1)*B of each micro-batch."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, k, p * B, 12, generator=g), torch.randn(STEPS, k, p * B, 5, generator=g)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1).clone() for q in module.parameters()])


def train(
    rank: int, p: int, zero: int, k: int, algorithm: str = "ring", clip: float | None = None
) -> dict[str, Any]:
    """STEPS AdamW steps of k micro-batches each; the final whole parameters and the losses."""
    net = make_net(rank)  # different on every rank: construction broadcasts rank 0's
    model: nn.Module
    if zero == 0:
        model = DistributedDataParallel(net, bucket_cap_mb=BUCKET_MB, algorithm=algorithm)
        params = list(net.parameters())
    else:
        model = ShardedDataParallel(net, zero=zero, bucket_cap_mb=BUCKET_MB, algorithm=algorithm)
        params = model.shard_parameters()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    xs, ys = data(p, k)
    rows = slice(rank * B, (rank + 1) * B)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for i in range(k):
            ctx = model.no_sync() if i < k - 1 else torch.enable_grad()  # type: ignore[operator]
            with ctx:
                loss = ((model(xs[step, i, rows]) - ys[step, i, rows]) ** 2).mean() / k
                loss.backward()
            losses.append(float(loss))
        if clip is not None and isinstance(model, ShardedDataParallel):
            model.clip_grad_norm_(clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)  # torch's, on the whole gradients
        opt.step()
    shard_numel = sum(local(q).numel() for q in params)
    if isinstance(model, ShardedDataParallel):
        model.close()
    return {"params": flat(net), "losses": torch.tensor(losses), "shard_numel": shard_numel}


def train_fsdp2(rank: int, p: int) -> dict[str, Any]:
    """The same run under torch's FSDP2 (fully_shard per linear layer, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = make_net(0)  # FSDP2 does not broadcast: every rank builds rank 0's model
    mesh = init_device_mesh("cpu", (p,))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    xs, ys = data(p, 1)
    rows = slice(rank * B, (rank + 1) * B)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = ((net(xs[step, 0, rows]) - ys[step, 0, rows]) ** 2).mean()
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return {"losses": torch.tensor(losses)}


def case_zero(rank: int, p: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in (1, 2):
        for zero in (0, 1, 2, 3):
            out[(zero, k)] = train(rank, p, zero, k)
    out["halving"] = train(rank, p, 3, 1, "halving_doubling")
    out["native"] = train(rank, p, 2, 1, "native")
    out["fsdp2"] = train_fsdp2(rank, p)
    out["clip0"], out["clip3"] = train(rank, p, 0, 1, clip=0.05), train(rank, p, 3, 1, clip=0.05)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    p = int(request.param)
    return p, spawn(case_zero, p, (p,), timeout_s=120)


def test_zero_matches_ddp(world: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = world
    for k in (1, 2):
        ddp = results[0][(0, k)]["params"]
        for zero in (1, 2, 3):
            for r in range(p):
                got = results[r][(zero, k)]["params"]
                assert (got - ddp).abs().max().item() <= 1e-5, (zero, k, r)
    for name in ("halving", "native"):
        assert (results[0][name]["params"] - results[0][(0, 1)]["params"]).abs().max().item() <= 1e-5


def test_shards_are_one_pth(world: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = world
    whole = results[0][(0, 1)]["shard_numel"]
    for zero in (1, 2, 3):
        shard = results[0][(zero, 1)]["shard_numel"]
        assert whole / p <= shard <= whole / p + 3 * p  # at most p - 1 padding elements per bucket


def test_refusals() -> None:
    from ringtree.parallel.sharded import _check_arguments

    with pytest.raises(ValueError, match="zero must be 1, 2 or 3"):
        _check_arguments(4, "ring", 25.0)
    with pytest.raises(ValueError, match="no reduce-scatter/all-gather schedule"):
        _check_arguments(2, "double_tree", 25.0)


def test_loss_curve_matches_fsdp2(world: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = world
    for r in range(p):
        ours, torchs = results[r][(3, 1)]["losses"], results[r]["fsdp2"]["losses"]
        assert len(ours) == STEPS
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)
        assert not torch.equal(ours[0], ours[-1])  # the model did learn something


def test_clip_grad_norm_matches_torchs(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    p, results = world
    clipped, plain = results[0]["clip0"]["params"], results[0][(0, 1)]["params"]
    assert (clipped - plain).abs().max().item() > 1e-4  # the clip did act
    for r in range(p):
        assert (results[r]["clip3"]["params"] - clipped).abs().max().item() <= 1e-5
