"""Real torch modules for `ringtree plan --module/--measure` (the only place the planner imports torch)."""

from __future__ import annotations

import statistics
import time
from typing import Any


def load_module(spec: str) -> Any:
    """Call `factory` of `pkg.mod:factory` and return the torch.nn.Module it builds."""
    import torch

    from ringtree.train.factories import call_factory

    module = call_factory(spec, "--module")
    if not isinstance(module, torch.nn.Module):
        raise ValueError(
            f"--module {spec!r}: the factory returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def count_parameters(spec: str) -> int:
    """Trainable parameters of the module (the gradients an all-reduce carries)."""
    return sum(p.numel() for p in load_module(spec).parameters() if p.requires_grad)


def parameter_shapes(spec: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The module's trainable tensors' shapes, in registration order (the order DDP buckets them),
    and its layers: the modules that hold parameters of their own."""
    return shapes_of(load_module(spec))


def run_model_shapes(model: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """`parameter_shapes` of the model a `ringtree train` summary names: a built-in model's name
    (mlp, vit, gpt, ...) or a `pkg.mod:factory`; ValueError for anything else."""
    from ringtree.train.models import REGISTRY, build_model

    if model in REGISTRY:
        return shapes_of(build_model(model))
    if ":" not in model:
        raise ValueError(f"model {model!r} is neither a built-in model nor a pkg.mod:factory")
    return parameter_shapes(model)


def shapes_of(module: Any) -> tuple[tuple[tuple[int, ...], ...], int]:
    """`parameter_shapes` of a built torch.nn.Module."""
    shapes = tuple(tuple(p.shape) for p in module.parameters() if p.requires_grad)
    layers = sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False)))
    return shapes, layers


def measure_step(spec: str, shape: list[int], warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of forward + backward of the module on a random input of `shape` (CPU)."""
    import torch

    module = load_module(spec)
    x = torch.randn(*shape)
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        module(x).float().sum().backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
