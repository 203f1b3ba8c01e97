"""ringtree.comm_hook in torch's own DistributedDataParallel: same parameters as torch's default hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringtree
from ringtree.processes import spawn

STEPS = 3


def train(hook: tuple[str, str | None] | None) -> list[torch.Tensor]:
    """STEPS SGD steps of a small MLP in torch's DDP (small buckets: several per step)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(None, ringtree.comm_hook(algorithm=hook[0], compression=hook[1]))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


HOOKS: list[tuple[str, str | None]] = [
    ("ring", None),
    ("halving_doubling", None),
    ("native", None),
    ("ring", "bf16"),
]


def hooked_runs(rank: int) -> dict[str, list[torch.Tensor]]:
    runs = {"default": train(None)}
    for algorithm, compression in HOOKS:
        runs[f"{algorithm}/{compression}"] = train((algorithm, compression))
    return runs


def test_comm_hook_matches_torch_default_hook() -> None:
    ranks = spawn(hooked_runs, 2, timeout_s=180)
    for runs in ranks:
        for name, params in runs.items():
            # two ranks: each sum adds the same two halves, so uncompressed hooks agree to rounding
            tol = 2e-2 if name.endswith("bf16") else 1e-6
            for got, want in zip(params, runs["default"], strict=True):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
    for name in ranks[0]:  # every rank holds the same parameters, bitwise
        for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
            assert torch.equal(a, b), name
    # and the hook changed something: the trained parameters differ from the initial ones
    torch.manual_seed(0)
    first = nn.Linear(16, 64).weight
    assert not torch.allclose(ranks[0]["ring/None"][0], first)


def test_comm_hook_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown all_reduce algorithm 'rign'"):
        ringtree.comm_hook(algorithm="rign")
    with pytest.raises(ValueError, match="unknown compression 'fp8'"):
        ringtree.comm_hook(compression="fp8")
