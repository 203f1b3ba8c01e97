"""Cutting a model into pipeline stages: consecutive layers, balanced by parameters or profiled time.

Indices: n layers, p stages, j stage. A stage is an nn.Sequential of the original layer objects,
so training the stages trains the model they were cut from.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn

BALANCES = ("params", "time")


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of an nn.Sequential (or a list of layers) applied one after another."""
    if isinstance(model, nn.Sequential | list | tuple):
        return list(model)
    raise TypeError(
        f"cannot cut a {type(model).__name__} into stages; pass an nn.Sequential or a list of layers "
        "(ringtree.train.stages.model_layers lists the mlp's and the vit's)"
    )


def split(layers: Sequence[nn.Module], sizes: Sequence[int]) -> list[nn.Sequential]:
    """Consecutive stages of the given numbers of layers."""
    if sum(sizes) != len(layers) or min(sizes, default=0) < 1:
        raise ValueError(
            f"stage sizes {list(sizes)} add up to {sum(sizes)} but the model has {len(layers)} layers; "
            f"give every stage at least one layer and make the sizes add up to {len(layers)}"
        )
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(bounds)]


def balance(costs: Sequence[float], p: int) -> list[int]:
    """Stage sizes for p stages of consecutive layers that minimise the most expensive stage."""
    n = len(costs)
    if p < 1 or p > n:
        raise ValueError(f"cannot cut {n} layers into {p} stages; use between 1 and {n} stages (--pp)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][q]: the smallest possible largest stage cost of the first q layers cut into k stages
    best = [[float("inf")] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for q in range(k, n - (p - k) + 1):
            for r in range(k - 1, q):
                cost = max(best[k - 1][r], prefix[q] - prefix[r])
                if cost < best[k][q]:
                    best[k][q], cut[k][q] = cost, r
    sizes, q = [], n
    for k in range(p, 0, -1):
        sizes.append(q - cut[k][q])
        q = cut[k][q]
    return sizes[::-1]


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameters per layer (a layer without any counts as one, so that it still costs something)."""
    return [float(max(1, sum(p.numel() for p in layer.parameters()))) for layer in layers]


def time_costs(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5) -> list[float]:
    """Median seconds of forward + backward per layer on `sample`, fed through the layers in order."""
    costs, x = [], sample
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.sum().backward()
            times.append(time.perf_counter() - start)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach()
    layer_params = [p for layer in layers for p in layer.parameters()]
    for param in layer_params:
        param.grad = None  # profiling must not leave gradients behind
    return costs


def partition(
    model: nn.Module | Sequence[nn.Module], p: int, by: str = "params", sample: torch.Tensor | None = None
) -> list[nn.Sequential]:
    """The model cut into p stages balanced by parameter count or by profiled time (needs `sample`)."""
    layers = layers_of(model)
    if by not in BALANCES:
        raise ValueError(f"unknown balance {by!r}; choose one of {', '.join(BALANCES)}")
    if by == "time" and sample is None:
        raise ValueError("balancing by time profiles the layers: pass a sample input batch")
    if p > len(layers):
        raise ValueError(
            f"cannot cut {len(layers)} layers into {p} stages; use between 1 and {len(layers)} stages"
        )
    costs = param_costs(layers) if by == "params" or sample is None else time_costs(layers, sample)
    return split(layers, balance(costs, p))
