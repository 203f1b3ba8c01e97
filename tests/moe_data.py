"""A small slice of the sort task for the MoE training tests: 4 optimizer steps at 64 sequences a step."""

from __future__ import annotations

from torch.utils.data import Subset, TensorDataset

from ringtree.train.language import sort_datasets


def small() -> tuple[Subset[TensorDataset], Subset[TensorDataset]]:
    train, test = sort_datasets()
    return Subset(train, range(256)), Subset(test, range(64))
