"""Reduction operators: names, torch's ReduceOp equivalents, and in-place combine functions."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Combine = Callable[[torch.Tensor, torch.Tensor], None]


def _sum(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x)


def _product(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.mul_(x)


def _max(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(acc, x, out=acc)


def _min(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(acc, x, out=acc)


COMBINE: dict[str, Combine] = {
    "sum": _sum,
    "avg": _sum,  # summed, then divided by p once at the end
    "product": _product,
    "max": _max,
    "min": _min,
}
OPS = tuple(COMBINE)

CombineInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _into(fn: Callable[..., torch.Tensor]) -> CombineInto:
    def combine_into(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        fn(acc, x, out=out)

    return combine_into


# out = acc (op) x, with the operands in the in-place combine's order (bitwise the same result).
COMBINE_INTO: dict[Combine, CombineInto] = {
    _sum: _into(torch.add),
    _product: _into(torch.mul),
    _max: _into(torch.maximum),
    _min: _into(torch.minimum),
}

TORCH_OP: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
)


def check_op(op: str, dtype: torch.dtype) -> None:
    if op not in COMBINE:
        raise ValueError(f"unknown reduction op {op!r}; choose one of {', '.join(OPS)}")
    if dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"dtype {dtype} is not supported; use one of {names}")
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"op 'avg' needs a floating-point tensor, got {dtype}; use 'sum' and divide")
