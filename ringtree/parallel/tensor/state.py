"""Unsharded checkpoints of a tensor-parallel model: gather every shard on save, cut it again on load.

A parallel model registers its parameters in the dense model's order (ParallelBlock keeps the
dense Block's), so the conversion pairs parameters by position, and the optimizer state (keyed by
position too) converts the same way. Saved from tp=2, a checkpoint loads at tp=1 and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringtree.parallel.tensor.layers import Shard, _ParallelLinear
from ringtree.parallel.tensor.ops import Group

Cut = tuple[Shard | None, Group, str]  # a parameter's shard (None: replicated), group, algorithm


def parameter_cuts(model: nn.Module) -> list[Cut]:
    """How each parameter of `model`, in parameters() order, is cut across its TP group."""
    cuts: dict[int, Cut] = {}
    for m in model.modules():
        if isinstance(m, _ParallelLinear):
            for name, shard in m.shards().items():
                cuts[id(getattr(m, name))] = (shard, m.group, m.algorithm)
    return [cuts.get(id(p), (None, None, "ring")) for p in model.parameters()]


def _gather(t: torch.Tensor, cut: Cut) -> torch.Tensor:
    shard, group, algorithm = cut
    return t.detach().clone() if shard is None else shard.gather(t, group, algorithm)


def _take(full: torch.Tensor, cut: Cut) -> torch.Tensor:
    shard, group, _ = cut
    if shard is None:
        return full
    return shard.take(full, torch.distributed.get_rank(group), torch.distributed.get_world_size(group))


def copy_to_dense(model: nn.Module, dense: nn.Module) -> None:
    """Gather `model`'s parameters into the dense model (collective over every TP group)."""
    pairs = _pairs(model, dense)
    with torch.no_grad():
        for (p, cut), d in pairs:
            d.copy_(_gather(p, cut))


def copy_from_dense(model: nn.Module, dense: nn.Module) -> None:
    """Load this rank's shard of every dense parameter into `model` (no communication)."""
    with torch.no_grad():
        for (p, cut), d in _pairs(model, dense):
            p.copy_(_take(d, cut))


def gather_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with every per-parameter tensor gathered to its dense shape."""
    cuts, params = parameter_cuts(model), list(model.parameters())
    return _map_state(state, lambda i, t: _gather(t, cuts[i]) if t.shape == params[i].shape else t)


def shard_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The reverse of gather_optimizer_state: this rank's shard of every dense-shaped tensor."""
    cuts, params = parameter_cuts(model), list(model.parameters())
    return _map_state(state, lambda i, t: _take(t, cuts[i]) if t.dim() and t.shape != params[i].shape else t)


def _map_state(state: dict[str, Any], fn: Callable[[int, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    per_param = {
        i: {k: fn(i, v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return {**state, "state": per_param}


def _pairs(model: nn.Module, dense: nn.Module) -> list[tuple[tuple[torch.Tensor, Cut], torch.Tensor]]:
    params, full = list(model.parameters()), list(dense.parameters())
    if len(params) != len(full):
        raise ValueError(
            f"the parallel model has {len(params)} parameters but the dense one {len(full)}; they must "
            f"be the same architecture"
        )
    return list(zip(zip(params, parameter_cuts(model), strict=True), full, strict=True))
