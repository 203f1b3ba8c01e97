"""Sequence parallelism (Megatron-LM): the collectives that move the sequence dimension between ranks.

Between the tensor-parallel layers of a transformer block the residual stream, its norms and
dropouts run on t/tp tokens per rank. Each operator is defined with its dual:

| operator                 | forward                         | backward                        |
|--------------------------|---------------------------------|---------------------------------|
| scatter_sequence         | keep this rank's t/tp tokens    | all-gather the tokens           |
| gather_sequence          | all-gather the tokens           | keep this rank's t/tp tokens    |
| all_gather_sequence      | all-gather the tokens           | reduce-scatter the tokens       |
| reduce_scatter_sequence  | reduce-scatter the tokens       | all-gather the tokens           |

scatter/gather mark the ends of the region (the gathered output is used identically on every
rank); all-gather/reduce-scatter replace the f and g all-reduces of the column- and row-parallel
layers inside it. Tensors are [b, t, ...]: the sequence is dimension 1.

A parameter replicated over the TP group inside the region (a norm's weight; a router, the experts
of an MoE layer) sees only this rank's t/tp tokens, so its gradient is partial: `sum_over_sequence`
marks it (Megatron's `param.sequence_parallel`) and sums its gradient over the group as backward
makes it. Code that adds such a parameter later (expert parallelism keeps a slice of the experts)
or counts tokens beside it (the router's load statistics) reads the mark: `sequence_group`.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ringtree.parallel.tensor.ops import (
    Group,
    all_gather_last_dim,
    gather_from_tp_region,
    reduce_scatter_last_dim,
    scatter_to_tp_region,
    tp_size,
)

SEQ = 1  # the sequence dimension of [b, t, d]


def sum_over_sequence(p: torch.Tensor, group: Group) -> None:
    """Mark `p` as replicated over the TP `group` while each rank feeds it its own tokens, and sum
    its gradient over the group as backward makes it (the whole sequence's gradient)."""
    p.sequence_parallel = True  # type: ignore[attr-defined]  # Megatron's mark
    p.sequence_group = group  # type: ignore[attr-defined]
    p.register_hook(lambda g: _sum_over(g, group))  # type: ignore[no-untyped-call]


def sequence_group(p: torch.Tensor) -> tuple[bool, Group]:
    """(whether `p` is marked by sum_over_sequence, the TP group it is summed over)."""
    return bool(getattr(p, "sequence_parallel", False)), getattr(p, "sequence_group", None)


def _sum_over(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated parameter's gradient from t/tp tokens, summed to the whole sequence's."""
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total


def _check(x: torch.Tensor, group: Group) -> None:
    p = tp_size(group)
    if x.shape[SEQ] % p:
        raise ValueError(
            f"sequence parallelism splits {x.shape[SEQ]} tokens among tp={p} ranks; use sequences whose "
            f"length is a multiple of {p} or drop --sequence-parallel"
        )


def scatter_sequence(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """[b, t, d] -> this rank's [b, t/tp, d]; backward all-gathers the gradient."""
    _check(x, group)
    return scatter_to_tp_region(x.movedim(SEQ, -1), group, algorithm).movedim(-1, SEQ).contiguous()


def gather_sequence(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """[b, t/tp, d] -> [b, t, d] on every rank; backward keeps this rank's slice of the gradient."""
    return gather_from_tp_region(x.movedim(SEQ, -1), group, algorithm).movedim(-1, SEQ).contiguous()


def all_gather_sequence(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """[b, t/tp, d] -> [b, t, d]; backward reduce-scatters (the ranks' uses differ: partial gradients)."""
    return all_gather_last_dim(x.movedim(SEQ, -1), group, algorithm).movedim(-1, SEQ).contiguous()


class SharedGather:
    """One all-gather for the layers that read the same input (q, k and v; gate and up).

    Each column-parallel layer asks for its input gathered; the first call gathers, the next ones
    with the very same tensor get the same result, so the whole sequence is held (and saved for
    backward) once, and its gradients are summed into one reduce-scatter, as Megatron's fused qkv.
    """

    def __init__(self) -> None:
        self._input: weakref.ref[torch.Tensor] | None = None
        self._output: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        if self._input is not None and self._input() is x and self._output is not None:
            return self._output
        out = all_gather_sequence(x, group, algorithm)
        self._input, self._output = weakref.ref(x), out
        return out

    def clear(self) -> None:
        self._input = self._output = None


def reduce_scatter_sequence(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """Partial sums [b, t, d] -> this rank's summed [b, t/tp, d]; backward all-gathers."""
    _check(x, group)
    return reduce_scatter_last_dim(x.movedim(SEQ, -1), group, algorithm).movedim(-1, SEQ).contiguous()
