"""Tied weights under ZeRO-3: the gpt whose output head shares the token embedding trains, sharded,
to DDP's parameters (<= 1e-5 after a few AdamW steps), the shared weight kept once in the shards."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ringtree.parallel import DistributedDataParallel, ShardedDataParallel
from ringtree.processes import spawn
from ringtree.train.factories import make_model
from ringtree.train.language import IGNORE, sort_datasets

STEPS, B = 3, 4


def train(rank: int, zero: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = make_model("gpt-tied")
    assert net.head.out.weight is net.embed.tokens.weight  # type: ignore[union-attr]
    model: Any = DistributedDataParallel(net) if zero == 0 else ShardedDataParallel(net, zero=zero)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = sort_datasets()[0].tensors
    for step in range(STEPS):
        rows = slice((2 * step + rank) * B, (2 * step + rank + 1) * B)
        opt.zero_grad()
        out = model(x[rows])
        F.cross_entropy(out.flatten(0, 1), y[rows].flatten(), ignore_index=IGNORE).backward()
        opt.step()
    shards = sum(1 for _ in model.parameters())
    if zero:
        model.close()
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()}, "shards": shards}


def runs(rank: int) -> dict[int, Any]:
    return {zero: train(rank, zero) for zero in (0, 3)}


def test_tied_weights_under_zero3_train_as_under_ddp() -> None:
    for r in spawn(runs, 2, timeout_s=120):
        ddp, zero3 = r[0]["params"], r[3]["params"]
        assert "head.out.weight" not in ddp  # named once: the embedding's
        for name, value in ddp.items():
            torch.testing.assert_close(zero3[name], value, rtol=0, atol=1e-5, msg=name)
        first = make_model_params()
        assert not torch.equal(ddp["embed.tokens.weight"], first["embed.tokens.weight"])  # it trained


def make_model_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach() for n, p in make_model("gpt-tied").named_parameters()}
