"""The refusal of an optimizer that would step parameters which never get a gradient.

ShardedDataParallel moves each gradient into its bucket and drops the parameter's own `.grad`:
an optimizer built over the wrapped module's whole parameters (`net.parameters()` instead of the
wrapper's `model.parameters()`) would step nothing, every step, in silence. torch calls a global
optimizer pre-step hook; this one raises, at such an optimizer's first step, naming the fix.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_whole: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed = False


class WrongParametersError(ValueError):
    """An optimizer over the whole parameters of a sharded model."""


def guard_whole_parameters(params: Iterable[nn.Parameter]) -> None:
    """Refuse any optimizer that steps one of `params` (the whole parameters a wrapper shards)."""
    global _installed
    for p in params:
        _whole[id(p)] = p
    if not _installed:
        register_optimizer_step_pre_hook(_check)
        _installed = True


def unguard(params: Iterable[nn.Parameter]) -> None:
    """Allow `params` again (the wrapper closed: the whole parameters are the trained ones)."""
    for p in params:
        if _whole.get(id(p)) is p:
            del _whole[id(p)]


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _whole.get(id(p)) is p:
                raise WrongParametersError(
                    "this optimizer steps the whole parameters of a module wrapped in "
                    "ShardedDataParallel, which never receive a gradient (they live in the shards); "
                    "build it over the wrapper's: torch.optim.AdamW(model.parameters())"
                )
    _checked.add(optimizer)
