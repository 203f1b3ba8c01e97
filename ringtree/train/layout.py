"""Where a rank's piece of a parameter sits in the dense model: the coordinates checkpoints use.

A ZeRO shard holds a flat range of a (TP-local) parameter; tensor parallelism cut that parameter
from the dense one along one dimension (in `stride` interleaved groups for a fused qkv). A
checkpoint keys every piece by the dense parameter's name and its N-D offsets in the dense
shape, as torch.distributed.checkpoint keys a DTensor's shards, so that a run of any TP, PP,
ZeRO stage and DP size asks for the boxes it now holds and DCP's resharding reads the overlaps.

A flat range [a, c) of a row-major tensor is a few boxes, each itself contiguous: a partial first
row, whole rows, a partial last row (recursively, per dimension). Index names: d the TP-cut dim,
n the elements of one interleaved group along d on a rank, k the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ringtree.parallel.tensor.state import parameter_cuts

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first flat index)


@dataclass(frozen=True)
class Place:
    """A rank's parameter in the dense model: its name and shape there, and the TP cut (if any)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None = None  # None: whole (replicated across the TP group)
    stride: int = 1
    rank: int = 0
    tp: int = 1


@dataclass(frozen=True)
class Chunk:
    """One box of a piece in dense coordinates, and where its values sit in the piece.

    The values: piece[first : first + prod(box)].view(box), narrowed along `dim` to
    [start, start + length) when a TP interleave splits the box (dim None: the whole box)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    first: int
    box: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0

    def view(self, piece: torch.Tensor) -> torch.Tensor:
        """This chunk's values as a view into the flat `piece` (of the range the chunks cut)."""
        out = piece[self.first : self.first + math.prod(self.box)].view(self.box)
        return out if self.dim is None else out.narrow(self.dim, self.start, self.length)


def places(net: nn.Module, dense: list[tuple[str, tuple[int, ...]]]) -> dict[int, Place]:
    """Each parameter of the (TP-sharded) `net`, paired by position with the dense model's."""
    params = list(net.parameters())
    if len(params) != len(dense):
        raise ValueError(
            f"the parallel model has {len(params)} parameters but the dense one {len(dense)}; "
            "they must be the same architecture"
        )
    out = {}
    for p, (name, shape), (shard, group, _) in zip(params, dense, parameter_cuts(net), strict=True):
        if shard is None:
            out[id(p)] = Place(name, shape)
        else:
            tp = torch.distributed.get_world_size(group)
            rank = torch.distributed.get_rank(group)
            out[id(p)] = Place(name, shape, shard.dim, shard.stride, rank, tp)
    return out


def whole(net: nn.Module) -> dict[int, Place]:
    """Places of a model no TP cut: every parameter whole, under its own name."""
    return {id(p): Place(n, tuple(p.shape)) for n, p in net.named_parameters()}


def flat_boxes(shape: tuple[int, ...], a: int, c: int) -> list[Box]:
    """[a, c) of a row-major tensor of `shape` as boxes, each a contiguous range of it."""
    if a >= c:
        return []
    if len(shape) <= 1:
        return [((a,), (c - a,), a)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(c, inner)

    def row(i: int, lo: int, hi: int) -> list[Box]:
        return [((i, *o), (1, *z), i * inner + f) for o, z, f in flat_boxes(shape[1:], lo, hi)]

    if i0 == i1:
        return row(i0, r0, r1)
    out = []
    if r0:
        out += row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *[0] * (len(shape) - 1)), (i1 - i0, *shape[1:]), i0 * inner))
    if r1:
        out += row(i1, 0, r1)
    return out


def chunks(place: Place, local: tuple[int, ...], start: int, length: int) -> list[Chunk]:
    """The dense-coordinate chunks of elements [start, start + length) of the rank's parameter."""
    out = []
    for offsets, sizes, first in flat_boxes(local, start, start + length):
        if place.dim is None:
            out.append(Chunk(offsets, sizes, first - start, sizes))
            continue
        d, n = place.dim, local[place.dim] // place.stride
        u, end = offsets[d], offsets[d] + sizes[d]
        while u < end:  # split where an interleaved group ends
            k = u // n
            v = min(end, (k + 1) * n)
            at = k * place.tp * n + place.rank * n + (u - k * n)
            dense = (*offsets[:d], at, *offsets[d + 1 :])
            out.append(
                Chunk(
                    dense,
                    (*sizes[:d], v - u, *sizes[d + 1 :]),
                    first - start,
                    sizes,
                    d,
                    u - offsets[d],
                    v - u,
                )
            )
            u = v
    return out
