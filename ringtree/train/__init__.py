"""Training: one Trainer for every parallelism, its configuration, models, data, checkpoints, traces.

`from ringtree.train import Trainer, TrainConfig`. The names load on first use, so that the
command line can read the configuration's fields without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringtree.train.config import TrainConfig
    from ringtree.train.trainer import RankResult, Trainer

__all__ = ["RankResult", "TrainConfig", "Trainer"]


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":
        from ringtree.train.config import TrainConfig

        return TrainConfig
    if name in ("Trainer", "RankResult"):
        from ringtree.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'ringtree.train' has no attribute {name!r}")
