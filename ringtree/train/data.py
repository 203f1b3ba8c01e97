"""The digits data set (scikit-learn's 8x8 handwritten digits: no download), with a fixed split."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

SPLIT_SEED = 0  # the split never depends on --seed: every run is evaluated on the same digits
TEST_FRACTION = 0.2  # 1797 digits: 1438 to train on, 359 held out
PIXELS = 64  # 8 x 8 gray levels
CLASSES = 10


def digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): inputs [n, 64] scaled to [0, 1], labels [n] int64."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # gray levels 0..16
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])
