"""Flat buckets of parameters, padded and cut into p blocks: one shard per data-parallel rank.

A bucket's parameters become views into one flat buffer `full` of `padded(numel, p)` elements;
rank r owns `full[r*s : (r+1)*s]` (s = the padded size / p). With `separate`, the shard is its own
tensor and `full` can be freed (its storage resized to 0) and gathered again, the parameters'
views staying valid: FSDP's flat-parameter trick.

Given a device mesh over the group, the shard is a DTensor (the padded flat buffer, Shard(0)),
as FSDP2's parameters are: torch's own `clip_grad_norm_` then sums the norm over every rank, and
the optimizer steps it like any parameter. `local` is this rank's block as a plain tensor.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def padded(numel: int, p: int) -> int:
    """numel rounded up to a multiple of p (every rank's block the same size)."""
    return max(1, math.ceil(numel / p)) * p


@dataclass
class FlatBucket:
    """One bucket: its parameters (views into `full`), this rank's `shard`, the gradient being filled."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int  # without padding
    full: torch.Tensor
    shard: nn.Parameter
    block: slice  # this rank's elements of `full`
    grad: torch.Tensor | None = None  # the flat gradient filled during backward (then reduced)
    ready: set[int] = field(default_factory=set)
    gathered: bool = True
    pinned: bool = False  # close(): stays gathered
    users: int = 0  # zero 3: modules whose parameters live here, and how many ran forward
    forwards: int = 0
    version: int = 0  # shard._version when `full` was last gathered
    prefetch: Future[None] | None = None  # zero 3: an all-gather started ahead of its use

    @property
    def local(self) -> torch.Tensor:
        """This rank's block as a plain tensor (the DTensor's local part, or the shard itself)."""
        return local(self.shard)

    def stepped(self) -> bool:
        """True when the optimizer changed the shard since `full` was gathered."""
        return self.shard._version != self.version  # the DTensor's own: its local part's never moves

    def mark_gathered(self) -> None:
        self.gathered, self.version = True, self.shard._version

    def allocate(self) -> None:
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())

    def free(self) -> None:
        """Release `full`'s memory (the parameters' views stay, pointing at an empty storage)."""
        if self.local.untyped_storage().data_ptr() != self.full.untyped_storage().data_ptr():
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def take(self, i: int, grad: torch.Tensor) -> None:
        """Copy parameter i's gradient into the flat gradient (added, when it already arrived)."""
        if self.grad is None:
            self.grad = torch.zeros(self.full.numel(), dtype=self.full.dtype, device=self.full.device)
        view = self.grad[self.offsets[i] : self.offsets[i] + self.params[i].numel()]
        if i in self.ready:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self.ready.add(i)

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def fill_missing(self) -> None:
        """Parameters that got no gradient in a backward that reached the bucket count as zero."""
        if self.ready and not self.complete():
            for i in range(len(self.params)):
                if i not in self.ready:
                    self.take(i, torch.zeros_like(self.params[i], memory_format=torch.contiguous_format))

    def take_payload(self) -> torch.Tensor:
        assert self.grad is not None
        payload, self.grad = self.grad, None
        self.ready.clear()
        return payload

    def add_shard_grad(self, block: torch.Tensor) -> None:
        if self.shard.grad is None:
            self.shard.grad = as_shard(block, self.shard)
        else:
            local(self.shard.grad).add_(block)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (this rank's block); a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def as_shard(block: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`block` as a tensor of the kind `like` is: a DTensor on its mesh, or plain."""
    if not isinstance(like, DTensor):
        return block
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(block, mesh, placements, shape=like.shape, stride=like.stride())


def flatten(
    index: int,
    named: list[tuple[str, nn.Parameter]],
    p: int,
    r: int,
    *,
    separate: bool,
    mesh: DeviceMesh | None = None,
) -> FlatBucket:
    """Make the parameters views into one padded flat buffer; rank r's block is its shard (a
    DTensor over `mesh` when one is given)."""
    params = [q for _, q in named]
    offsets, total = [], 0
    for q in params:
        offsets.append(total)
        total += q.numel()
    first = params[0]
    full = torch.zeros(padded(total, p), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for q, off in zip(params, offsets, strict=True):
            full[off : off + q.numel()].copy_(q.detach().reshape(-1))
            q.data = full[off : off + q.numel()].view_as(q)
    s = full.numel() // p
    block = slice(r * s, (r + 1) * s)
    mine = full[block].clone() if separate else full[block]
    data = mine if mesh is None else DTensor.from_local(mine, mesh, [Shard(0)], shape=full.shape, stride=(1,))
    shard = nn.Parameter(data)
    return FlatBucket(index, params, [n for n, _ in named], offsets, total, full, shard, block)
