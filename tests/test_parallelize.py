"""The parallelize step on its own, in a world of one: DDP or ZeRO around the model, what the
optimizer steps, and activation checkpointing that computes what the plain model computes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree.parallel import DistributedDataParallel, Mesh, ShardedDataParallel
from ringtree.train import TrainConfig
from ringtree.train.loss import TrainingLoss
from ringtree.train.parallelize import Parallelized, parallelize
from ringtree.train.techniques import MixedPrecision


@pytest.fixture
def world() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _no_sample() -> torch.Tensor:
    raise AssertionError("only a pipeline cut asks for a sample batch")


def _made(net: nn.Module, cfg: TrainConfig) -> Parallelized:
    loss = TrainingLoss(F.mse_loss, cfg, None, MixedPrecision("off", "cpu"))
    return parallelize(net, cfg, Mesh(), torch.device("cpu"), loss=loss, sample=_no_sample)


def test_zero_0_wraps_the_model_in_ddp_and_the_optimizer_steps_its_parameters(world: None) -> None:
    net = _net()
    made = _made(net, TrainConfig(progress=False))
    assert isinstance(made.model, DistributedDataParallel) and made.model.module is net
    assert (made.pipe, made.threaded, made.sharded, made.segments) == (None, None, None, 0)
    assert [id(p) for p in made.trained] == [id(p) for p in net.parameters()]


def test_zero_2_wraps_the_model_in_sharded_dp_and_the_optimizer_steps_its_shards(world: None) -> None:
    net = _net()
    made = _made(net, TrainConfig(progress=False, zero=2))
    assert isinstance(made.model, ShardedDataParallel) and made.sharded is made.model
    assert [id(p) for p in made.trained] == [id(p) for p in made.model.shard_parameters()]
    assert not {id(p) for p in made.trained} & {id(p) for p in net.parameters()}
    assert sum(p.numel() for p in made.trained) == sum(p.numel() for p in net.parameters())  # dp 1


def test_checkpointing_counts_its_segments_and_computes_what_the_plain_model_does(world: None) -> None:
    net, plain = _net(), _net()
    made = _made(net, TrainConfig(progress=False, checkpoint_activations=True, checkpoint_segments=2))
    assert made.segments == 2
    assert made.model is not None
    x = torch.randn(6, 4)
    torch.testing.assert_close(made.model(x), plain(x), rtol=0, atol=0)
