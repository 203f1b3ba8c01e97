"""Fusion buckets: gradients grouped in reverse registration order into flat buffers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MB = 1 << 20

# torch's DDP caps its first bucket at 1 MiB: the last layers' gradients are ready first, and a
# small first bucket starts communication early instead of waiting for 25 MB of gradients.
FIRST_BUCKET_CAP_MB = 1.0


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, and the flat buffer they are copied into.

    `params[i]` occupies `buffer[offsets[i] : offsets[i] + params[i].numel()]`; `views[i]` is that
    slice shaped like the parameter (made once: DDP hands it to the parameter as its `.grad`).
    """

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0  # gradients not yet ready in the current backward pass
    ready: set[int] = field(default_factory=set)  # positions (into params) whose gradient arrived
    views: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets, strict=True)
        ]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, i: int) -> torch.Tensor:
        """The slice of the flat buffer that holds parameter i's gradient, shaped like it."""
        return self.views[i]

    def holds(self, i: int, grad: torch.Tensor | None) -> bool:
        """Whether `grad` is parameter i's slice of the buffer itself (its gradient is a bucket view)."""
        view = self.views[i]
        return grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready.clear()


def assign(
    named: Sequence[tuple[str, torch.nn.Parameter]],
    cap_bytes: int,
    first_cap_bytes: int = int(FIRST_BUCKET_CAP_MB * MB),
) -> list[list[int]]:
    """Group parameter indices into buckets in reverse order, closing a bucket once it reaches its cap.

    Parameters of different dtype or device never share a bucket. The first bucket's cap is
    min(first_cap_bytes, cap_bytes); every later bucket's is cap_bytes.
    """
    groups: list[list[int]] = []
    open_by_kind: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(named))):
        p = named[i][1]
        kind = (p.dtype, p.device)
        members, size = open_by_kind.get(kind, ([], 0))
        if not members:
            groups.append(members)
        members.append(i)
        size += p.numel() * p.element_size()
        cap = min(first_cap_bytes, cap_bytes) if members is groups[0] else cap_bytes
        if size >= cap:
            open_by_kind.pop(kind, None)
        else:
            open_by_kind[kind] = (members, size)
    return groups


# Where a bucket's zeroed flat buffer comes from: (elements, dtype) -> tensor, or None for torch.zeros.
Allocator = Callable[[int, torch.dtype], torch.Tensor | None]


def build(
    named: Sequence[tuple[str, torch.nn.Parameter]], cap_bytes: int, alloc: Allocator | None = None
) -> list[Bucket]:
    """Buckets for the parameters that require gradients, each with a zeroed flat buffer (from
    `alloc` where it gives one: DDP's buffers in the shared-memory transport)."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    buckets = []
    for j, members in enumerate(assign(trainable, cap_bytes)):
        params = [trainable[i][1] for i in members]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = alloc(total, params[0].dtype) if alloc is not None else None
        if buffer is None:
            buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        buckets.append(Bucket(j, params, [trainable[i][0] for i in members], offsets, buffer))
    return buckets
