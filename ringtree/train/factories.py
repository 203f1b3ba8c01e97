"""What `--model`, `--dataset` and `--loss` name: a built-in, or a user's `pkg.mod:factory`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ringtree.train.config import TrainConfig
from ringtree.train.data import digits
from ringtree.train.language import sort_datasets
from ringtree.train.models import build_model
from ringtree.train.moe import MoEGPT, MoESettings

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torch's cross entropy; for sequences ([b, t, V] logits, [b, t] ids) over every token not ignored."""
    if output.dim() == target.dim() + 1 and output.dim() > 2:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())
    return F.cross_entropy(output, target)


BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": F.mse_loss}


def call_factory(spec: str, option: str) -> Any:
    """Import `pkg.mod`, call its `factory()` and return what it made (ValueError naming the option)."""
    path, _, name = spec.partition(":")
    if not path or not name:
        raise ValueError(f"{option} {spec!r}: write it as pkg.mod:factory")
    try:
        factory = getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{option} {spec!r}: cannot load it ({e})") from None
    return factory()


def make_model(name: str, cfg: TrainConfig | None = None) -> nn.Module:
    """A built-in model (from torch's current seed) or the nn.Module a factory returns; `cfg`, when
    given, sets --model moe's layers (--experts, --top-k, ...)."""
    if name == "moe" and cfg is not None:
        return moe_model(cfg)
    if ":" not in name:
        return build_model(name)
    model = call_factory(name, "--model")
    if isinstance(model, list | tuple):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def moe_model(cfg: TrainConfig) -> nn.Module:
    """--model moe with the configuration's MoE options."""
    settings = MoESettings(
        experts=cfg.get("experts"),
        top_k=cfg.get("top_k"),
        every=cfg.get("moe_every"),
        shared=cfg.get("shared_experts"),
        score=cfg.get("router_score"),
        capacity_factor=cfg.capacity_factor,
        aux_loss=cfg.get("router_aux_loss"),
    )
    return MoEGPT(moe=settings)


def make_datasets(name: str) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """(train, test or None): the digits split, or a factory's Dataset or (train, test) pair."""
    if name == "digits":
        return digits()
    if name == "sort":
        return sort_datasets()
    made = call_factory(name, "--dataset")
    if isinstance(made, tuple) and len(made) == 2:
        return made[0], made[1]
    if not isinstance(made, Dataset):
        raise ValueError(
            f"--dataset {name!r}: the factory returned {type(made).__name__}, not a Dataset or (train, test)"
        )
    return made, None


def make_loss(name: str) -> LossFn:
    """A built-in loss or the callable (e.g. an nn.Module loss) a factory returns."""
    if name in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[name]
    loss = call_factory(name, "--loss")
    if not callable(loss):
        raise ValueError(f"--loss {name!r}: the factory returned {type(loss).__name__}, not a callable")
    return loss  # type: ignore[no-any-return]
