"""Tensor parallelism in the trainer: the plan, the shards, dense checkpoints gathered and cut by position."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel.tensor import gather_optimizer_state, parallelize_blocks, shard_optimizer_state
from ringtree.parallel.tensor.layers import _ParallelLinear
from ringtree.parallel.tensor.plan import check_plan, load_plan, parallelize
from ringtree.parallel.tensor.state import _gather, _take, parameter_cuts
from ringtree.train.config import TrainConfig


def plan_of(net: nn.Module, cfg: TrainConfig) -> dict[str, str] | None:
    """The TP plan in effect: --tp-plan (a file, or a dict in the library), else the model's own."""
    if isinstance(cfg.tp_plan, str):
        return load_plan(cfg.tp_plan)
    if cfg.tp_plan is not None:
        return dict(cfg.tp_plan)
    own = getattr(net, "tp_plan", None)
    return dict(own) if isinstance(own, dict) else None


def check(net: nn.Module, cfg: TrainConfig) -> None:
    """ValueError, before training, for a model --tp cannot shard as the config asks."""
    if cfg.tp == 1:
        return
    plan = plan_of(net, cfg)
    if plan is not None:
        check_plan(net, plan, cfg.tp)
    elif not isinstance(getattr(net, "blocks", None), nn.ModuleList):
        raise ValueError(
            f"--tp {cfg.tp} needs a plan of which layers to split: {type(net).__name__} carries none; "
            "pass --tp-plan FILE.yaml (module: colwise|rowwise) or use --tp 1"
        )
    if cfg.sequence_parallel and (plan is None or not hasattr(net, "enable_sequence_parallel")):
        raise ValueError(
            f"--sequence-parallel needs a model that marks where its sequence is split, which "
            f"{type(net).__name__} does not; use --model gpt or drop --sequence-parallel"
        )


def shard(net: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup | None) -> None:
    """Replace the layers TP splits by this rank's shards: by the plan, else the vit's blocks."""
    plan = plan_of(net, cfg)
    if plan is None:
        parallelize_blocks(net.blocks, group, cfg.algorithm)  # type: ignore[arg-type]
        return
    parallelize(net, plan, group, cfg.algorithm, sequence_parallel=cfg.sequence_parallel)


def is_parallel(net: nn.Module) -> bool:
    return any(isinstance(m, _ParallelLinear) for m in net.modules())


def model_state(net: nn.Module, dense: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The dense model's state_dict, its parameters gathered from the TP shards (collective: call on
    every rank); `dense` names the dense model's parameters in order (a library model's too)."""
    if not is_parallel(net):
        return net.state_dict()
    params = list(net.parameters())
    out = {
        name: _gather(p, cut) for (name, _), p, cut in zip(dense, params, parameter_cuts(net), strict=True)
    }
    return out | persistent_buffers(net)


def persistent_buffers(net: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state_dict holds (not those registered with persistent=False)."""
    buffers = dict(net.named_buffers())
    return {k: v.detach() for k, v in net.state_dict().items() if k in buffers}


def optimizer_state(
    net: nn.Module, optimizer: torch.optim.Optimizer, owned: set[int] | None = None
) -> dict[str, Any]:
    """The optimizer's state_dict in dense shapes (collective over the TP group, call on every rank).

    owned: keep only these parameters' state (a pipeline stage's; None: all).
    """
    state = optimizer.state_dict()
    if owned is not None:
        state = {**state, "state": {i: s for i, s in state["state"].items() if i in owned}}
    return gather_optimizer_state(net, state) if is_parallel(net) else state


def load(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    dense: list[tuple[str, tuple[int, ...]]],
    state: dict[str, Any],
) -> None:
    """Load a dense checkpoint, taking this rank's shard of every tensor-parallel parameter."""
    if not is_parallel(net):
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    model = state["model"]
    with torch.no_grad():
        for (name, _), p, cut in zip(dense, list(net.parameters()), parameter_cuts(net), strict=True):
            p.copy_(_take(model[name], cut))
        for n, b in persistent_buffers(net).items():
            b.copy_(model[n])
    optimizer.load_state_dict(shard_optimizer_state(net, state["optimizer"]))
    dist.barrier()


def union_over(state: dict[str, Any], group: dist.ProcessGroup, size: int) -> dict[str, Any]:
    """An optimizer state_dict whose per-parameter state is the union of every stage's."""
    states: list[Any] = [None] * size
    dist.all_gather_object(states, to_cpu(state), group=group)
    merged: dict[Any, Any] = {}
    for s in states:
        merged |= s["state"]
    return {**state, "state": merged}


def to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with its per-parameter tensors on the host (for saving, gathering)."""
    per = {
        i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return {**state, "state": per}
