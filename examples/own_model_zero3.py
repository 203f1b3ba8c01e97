"""Your own model, data and loss, trained with ZeRO-3 on 4 ranks.

Two ways, the same trainer:

    torchrun --nproc_per_node=4 examples/own_model_zero3.py                   # the library API
    PYTHONPATH=. ringtree train --nproc 4 --model examples.own_model_zero3:model \\
        --dataset examples.own_model_zero3:data --loss mse --zero 3 --epochs 5 --lr 1e-2

Each rank holds a quarter of the parameters, gradients and AdamW moments (`model_state_mb` in the
summary); a layer's parameters are all-gathered just before its forward and its backward.
"""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.train import TrainConfig, Trainer


def model() -> nn.Module:
    """Any nn.Module; an nn.Sequential can also be cut into pipeline stages (--pp)."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def data() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): y = sum of x's first four features, plus noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.01 * torch.randn(2048, 1, generator=g)
    return TensorDataset(x[:1792], y[:1792]), TensorDataset(x[1792:], y[1792:])


if __name__ == "__main__":
    train, test = data()
    config = TrainConfig(zero=3, epochs=5, lr=1e-2, batch_size=32, progress=False)
    summary = Trainer(model(), train, nn.MSELoss(), config, test_dataset=test).fit()
    if os.environ.get("RANK", "0") == "0":  # the summary is the same on every rank
        print({k: summary[k] for k in ("world_size", "zero", "test_loss", "model_state_mb")})
