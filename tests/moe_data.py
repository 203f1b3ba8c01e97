"""A small slice of the sort task for the MoE training tests: 4 optimizer steps at 64 sequences a step,
and the trainer run on it that those tests spawn."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Subset, TensorDataset

from ringtree.train import TrainConfig, Trainer
from ringtree.train.language import sort_datasets

SMALL = {
    "model": "moe",
    "dataset": "tests.moe_data:small",
    "epochs": 1,
    "progress": False,
    "straggler_every": 0,
}


def small() -> tuple[Subset[TensorDataset], Subset[TensorDataset]]:
    train, test = sort_datasets()
    return Subset(train, range(256)), Subset(test, range(64))


def train(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    """The MoE model trained on `small` with `options`: the summary (spawned per rank, or in-process)."""
    return Trainer.from_config(TrainConfig(**SMALL, **options)).fit()
