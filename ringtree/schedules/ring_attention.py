"""Ring attention as data: which chunks of a sequence each context-parallel rank holds, and at each
step of the ring whose keys and values it holds and which (query chunk, key chunk) blocks it computes.

Indices: p ranks, r rank, s step, c chunk. A causal sequence is cut into 2p chunks and rank r holds
chunks r and 2p-1-r (head-tail, "zigzag": the early chunk sees few keys, the late one many, so
every rank does the same work); without load balancing it is cut into p chunks and rank r holds
chunk r. At step s rank r holds the keys and values of rank (r - s) mod p: they came from rank
r-1 and leave for rank r+1, so after p-1 exchanges every rank has met every block. In backward
the same p-1 exchanges of K/V run again, and each block's gradients dK/dV ride the ring with it
(p exchanges: the last brings them home). A block is computed whole (the keys all precede the
queries), with the causal mask (the same chunk), or skipped (the keys all follow the queries).
The torch side (ringtree.parallel.context) runs exactly these blocks; `ringtree show
ring-attention` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, CAUSAL, SKIP = "full", "causal", "skip"
COMMS = ("p2p", "all-gather", "all-to-all")  # --cp-comm: the ring; one gather before attention; Ulysses


def chunks_per_rank(balanced: bool) -> int:
    """Chunks of the sequence a rank holds: 2 with head-tail load balancing, else 1."""
    return 2 if balanced else 1


def chunks(rank: int, p: int, balanced: bool) -> tuple[int, ...]:
    """The sequence chunks rank `rank` of `p` holds, in the order it holds them (ascending)."""
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not one of the {p} ranks")
    return (rank, 2 * p - 1 - rank) if balanced else (rank,)


def layout(p: int, balanced: bool) -> list[int]:
    """The chunk order of the ranks' shards laid end to end (rank 0's first): [0, 7, 1, 6, 2, 5, 3, 4]
    for p = 4 balanced. It is what an all-gather of the shards returns."""
    return [c for r in range(p) for c in chunks(r, p, balanced)]


def block_kind(q: int, k: int, causal: bool) -> str:
    """How query chunk q attends to key chunk k."""
    if not causal or q > k:
        return FULL
    return CAUSAL if q == k else SKIP


@dataclass(frozen=True)
class Block:
    """Query chunk q against key/value chunk k: full, causal, or skipped."""

    q: int
    k: int
    kind: str


@dataclass(frozen=True)
class RingStep:
    """Rank `rank` at step `step`: it holds the K/V of rank `source` and computes `blocks`."""

    step: int
    rank: int
    source: int
    blocks: tuple[Block, ...]

    @property
    def computed(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.kind != SKIP)


def ring_step(step: int, rank: int, p: int, causal: bool, balanced: bool) -> RingStep:
    """What rank `rank` holds and computes at step `step` of the ring."""
    source = (rank - step) % p
    blocks = tuple(
        Block(q, k, block_kind(q, k, causal))
        for q in chunks(rank, p, balanced)
        for k in chunks(source, p, balanced)
    )
    return RingStep(step, rank, source, blocks)


def ring_steps(p: int, causal: bool = True, balanced: bool = True) -> list[list[RingStep]]:
    """[step][rank]: the whole ring, p steps."""
    if p < 1:
        raise ValueError(f"context parallelism needs at least 1 rank, got {p}")
    return [[ring_step(s, r, p, causal, balanced) for r in range(p)] for s in range(p)]


def work(steps: list[list[RingStep]]) -> list[float]:
    """Per rank, the blocks computed in units of a whole chunk-by-chunk product (a causal one counts
    half): equal on every rank with head-tail balancing."""
    per = {FULL: 1.0, CAUSAL: 0.5, SKIP: 0.0}
    p = len(steps[0])
    return [sum(per[b.kind] for s in steps for b in s[r].blocks) for r in range(p)]


def exchanges(p: int, comm: str = "p2p") -> dict[str, int]:
    """Messages one rank sends per attention layer: forward and backward, for each --cp-comm.

    p2p: K/V to the next rank p-1 times forward; backward K/V again p-1 times and dK/dV p times
    (PyTorch's ring counts 3p-2 in all). all-gather: one all-gather of K/V forward, one
    reduce-scatter of dK/dV backward. all-to-all: q, k, v in and the output back forward (4), the
    same four mirrored backward.
    """
    if comm == "p2p":
        return {"forward": p - 1, "backward": 2 * p - 1}
    if comm == "all-gather":
        return {"forward": 1, "backward": 1}
    if comm == "all-to-all":
        return {"forward": 4, "backward": 4}
    raise ValueError(f"unknown context-parallel communication {comm!r}; choose p2p, all-gather or all-to-all")
