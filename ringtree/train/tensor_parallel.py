"""`ringtree train --tp N`: the vit's blocks tensor-parallel over a DP x TP mesh, checkpoints unsharded."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from ringtree.parallel import Mesh
from ringtree.parallel.tensor import (
    copy_from_dense,
    copy_to_dense,
    gather_optimizer_state,
    parallelize_blocks,
    shard_optimizer_state,
)
from ringtree.parallel.tensor.layers import _ParallelLinear
from ringtree.train.models import build_model


def check_tp(tp: int, model: str, mode: str, pp: int) -> None:
    """Raise ValueError for a --tp the trainer cannot run (sizes are checked when the mesh is built)."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    if tp == 1:
        return
    if model != "vit":
        raise ValueError(f"--tp {tp} shards transformer blocks; use --model vit (got {model!r}) or --tp 1")
    if mode != "ddp":
        raise ValueError(f"--tp {tp} runs with --mode ddp over the data-parallel groups, not {mode!r}")
    if pp != 1:
        raise ValueError(f"--tp {tp} with --pp {pp} is not supported yet; choose one of them")


def setup(net: nn.Module, tp: int, algorithm: str) -> Mesh | None:
    """Build the DP x TP mesh and shard the vit's blocks over its TP groups; None when tp == 1."""
    if tp == 1:
        return None
    mesh = Mesh(tp=tp)
    blocks = net.blocks
    assert isinstance(blocks, nn.ModuleList), "check_tp admits only the vit"
    parallelize_blocks(blocks, mesh.tp_group, algorithm)
    return mesh


def sampler(data: TensorDataset, mesh: Mesh | None, seed: int) -> DistributedSampler[Any]:
    """Each DP rank's share of every epoch; every rank of a TP group reads the same batches."""
    if mesh is None:
        return DistributedSampler(data, shuffle=True, seed=seed)
    return DistributedSampler(data, num_replicas=mesh.dp, rank=mesh.dp_rank, shuffle=True, seed=seed)


def is_parallel(net: nn.Module) -> bool:
    return any(isinstance(m, _ParallelLinear) for m in net.modules())


def model_state(net: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The dense model's state_dict (gathered from the shards: collective, call on every rank)."""
    if not is_parallel(net):
        return net.state_dict()
    dense = build_model(name)
    copy_to_dense(net, dense)
    return dense.state_dict()


def optimizer_state(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict in dense shapes (collective, call on every rank)."""
    state = optimizer.state_dict()
    return gather_optimizer_state(net, state) if is_parallel(net) else state


def load(net: nn.Module, optimizer: torch.optim.Optimizer, name: str, state: dict[str, Any]) -> None:
    """Load a dense checkpoint, taking this rank's shard of every tensor-parallel parameter."""
    if not is_parallel(net):
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    dense = build_model(name)
    dense.load_state_dict(state["model"])
    copy_from_dense(net, dense)
    optimizer.load_state_dict(shard_optimizer_state(net, state["optimizer"]))
    dist.barrier()
