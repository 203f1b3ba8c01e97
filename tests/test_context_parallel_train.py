"""Context parallelism in the trainer: the gpt with CP x TP x PP trains to plain data parallelism's
losses (8 ranks, a few steps), a user's model opts in through SDPA and trains to a one-process
loop's loss with each --cp-comm, bad input exits 2.

Tolerance: float32 with different summation orders over two steps, 1e-4 relative on losses (as the
other composed-layout tests).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_bad_input import _exits_2
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ringtree.parallel import SDPA, ContextParallel, MeshShape
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from ringtree.train.config import ConfigError
from ringtree.train.factories import cross_entropy
from ringtree.train.gpt import GPT, GPTConfig
from ringtree.train.language import sort_task
from ringtree.train.parallelize import check_context, check_sequence

GPT_SMALL = GPTConfig(dim=32, depth=2, heads=4, kv_heads=2, hidden=64)


def _composed(rank: int) -> dict[str, Any]:
    """The gpt on 8 ranks: plain DP 8 against CP 2 x TP 2 x PP 2 (8 sequences of 8 tokens a step)."""
    x, y = sort_task(24, length=4)
    train, test = TensorDataset(x[:16], y[:16]), TensorDataset(x[16:], y[16:])
    quiet = {"epochs": 1, "progress": False, "straggler_every": 0, "lr": 1e-2}
    layouts = {
        "plain": TrainConfig(batch_size=1, **quiet),
        "composed": TrainConfig(
            cp=2, tp=2, pp=2, sequence_parallel=True, micro_batches=2, batch_size=4, **quiet
        ),
        "ulysses": TrainConfig(
            cp=2, tp=2, pp=2, cp_comm="all-to-all", micro_batches=2, batch_size=4, **quiet
        ),
    }
    out = {}
    for name, cfg in layouts.items():
        torch.manual_seed(0)
        out[name] = Trainer(GPT(GPT_SMALL), train, cross_entropy, cfg, test_dataset=test).fit()
    return out


def test_gpt_cp_x_tp_x_pp_trains_as_plain_dp() -> None:
    result = spawn(_composed, 8, timeout_s=240)[0]
    plain = result["plain"]
    for name in ("composed", "ulysses"):
        run = result[name]
        assert (run["cp"], run["tp"], run["pp"], run["dp"], plain["dp"], plain["cp"]) == (2, 2, 2, 1, 8, 1)
        assert run["steps"] == plain["steps"] == 2
        for key in ("final_loss", "test_loss", "accuracy"):
            assert run[key] == pytest.approx(plain[key], rel=1e-4), (name, key)
    assert result["composed"]["cp_comm"] == "p2p" and "cp_comm" not in plain


class _TinyLM(nn.Module):
    """A user's one-layer causal language model that computes its attention through SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(20, 16), nn.Linear(16, 48), nn.Linear(16, 20)
        self.core = SDPA()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [b, t, 16]
        pos = self.core.positions(ids.shape[1], ids.device).float()  # [t]: learnable-free positions
        h = h + torch.sin(pos[:, None] / (1 + torch.arange(16)))  # [b, t, 16]
        q, k, v = self.qkv(h).view(*h.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)  # each [b, 2, t, 8]
        a = self.core(q, k, v, is_causal=True).transpose(1, 2).reshape(h.shape)  # [b, t, 16]
        return self.out(h + a)  # type: ignore[no-any-return]


def _reference(data: TensorDataset, steps: int) -> float:
    """The same training by hand, on one process: the sampler's order, AdamW, the last step's loss."""
    torch.manual_seed(0)
    net = _TinyLM()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=1e-4)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loss = torch.zeros(())
    for x, y in itertools.islice(DataLoader(data, batch_size=8, sampler=sampler), steps):
        opt.zero_grad()
        loss = cross_entropy(net(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return float(loss.detach())


def _users(rank: int) -> dict[str, Any]:
    """A user's model with cp=2 (each --cp-comm) on 2 ranks; targets ignored at random, so the ranks
    score different numbers of tokens and the loss must weigh them."""
    x, y = sort_task(32, length=4)
    y[torch.rand(y.shape, generator=torch.Generator().manual_seed(1)) < 0.3] = -100
    data = TensorDataset(x, y)
    quiet = {"epochs": 1, "progress": False, "straggler_every": 0, "lr": 1e-2, "batch_size": 8}
    out: dict[str, Any] = {"reference": _reference(data, 4)}
    for comm in ("p2p", "all-gather", "all-to-all"):
        torch.manual_seed(0)
        out[comm] = Trainer(_TinyLM(), data, cross_entropy, TrainConfig(cp=2, cp_comm=comm, **quiet)).fit()
    torch.manual_seed(0)
    out["zero3"] = Trainer(_TinyLM(), data, cross_entropy, TrainConfig(cp=2, zero=3, **quiet)).fit()
    torch.manual_seed(0)
    model = _TinyLM()
    cp = ContextParallel(None, "all-gather")
    assert cp.apply(model) == 1
    model.eval()
    with torch.no_grad():
        out["eval"] = model(x[:4])  # gathered back to [b, t, V] in eval mode
        torch.manual_seed(0)
        out["eval_ref"] = _TinyLM().eval()(x[:4])
    return out


def test_a_users_model_with_sdpa_trains_with_cp_and_zero_to_the_one_process_loss() -> None:
    result = spawn(_users, 2, timeout_s=120)[0]
    for comm in ("p2p", "all-gather", "all-to-all"):
        run = result[comm]
        assert (run["cp"], run["dp"], run["steps"], run["cp_comm"]) == (2, 1, 4, comm)
        assert run["final_loss"] == pytest.approx(result["reference"], rel=1e-4), comm
    assert result["zero3"]["final_loss"] == pytest.approx(result["reference"], rel=1e-4)  # over DP x CP
    assert torch.allclose(result["eval"], result["eval_ref"], atol=1e-5)


def test_the_mesh_folds_cp_between_tp_and_dp() -> None:
    m = MeshShape(dp=2, tp=2, pp=1, cp=2)
    assert m.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients: over DP x CP
    assert MeshShape(dp=2, tp=2, pp=2).pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # pp outermost


def test_cp_refusals_name_the_flag() -> None:
    x, y = sort_task(4)
    with pytest.raises(ValueError, match=r"--cp 2 splits each sequence .* Sequential has none"):
        check_context(nn.Sequential(nn.Linear(4, 4)), TrainConfig(cp=2))
    with pytest.raises(ValueError, match=r"2 x cp = 10 chunks .* hold 24 tokens; choose --cp among"):
        check_sequence(TensorDataset(x, y), TrainConfig(cp=5))
    with pytest.raises(ValueError, match=r"--cp-comm all-to-all gives each of the --cp 4 ranks"):
        check_context(GPT(), TrainConfig(cp=4, tp=2, cp_comm="all-to-all"))
    with pytest.raises(ConfigError, match=r"cp_comm needs cp=2 or more; drop it or add cp"):
        TrainConfig(cp_comm="all-gather")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--cp", "2", "--nproc", "2"],
            "--cp 2 splits each sequence for the model's attention, but MLP has none",
        ),
        (
            ["--model", "gpt", "--cp", "5", "--nproc", "5"],
            "--cp 5 cuts each sequence into 2 x cp = 10 chunks",
        ),
        (
            ["--model", "gpt", "--cp", "3", "--nproc", "3", "--cp-comm", "all-to-all"],
            "choose --cp dividing 4",
        ),
        (["--model", "gpt", "--cp-comm", "p2p"], "--cp-comm needs --cp 2 or more"),
        (["--model", "gpt", "--cp", "2", "--cp-comm", "ring"], "unknown --cp-comm 'ring'; choose one of p2p"),
        (
            ["--model", "gpt", "--cp", "2", "--nproc", "3"],
            "--cp 2 = 2 ranks per replica does not divide the 3",
        ),
    ],
)
def test_bad_cp_input_exits_2(tmp_path: Path, args: list[str], fragment: str) -> None:
    _exits_2(tmp_path, ["train", *args], fragment)
