"""An all-to-all schedule step by step: who sends which block to whom, what each rank holds, its cost.

Blocks are named by their journey: 0→3 is rank 0's block for rank 3. A rank starts with its own
row (its input), ends with its column (its output), and in Bruck and hierarchical holds other
ranks' blocks while it forwards them. The cost is the alpha-beta model's: a step costs alpha per
message of the rank that sends the most messages (one port) plus the busiest port's bytes times
beta, charged to the link between nodes when the busiest message crosses them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ringtree.schedules import OpKind, Request, Schedule, build
from ringtree.schedules.verify import dry_run
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.topology import Topology

# `ringtree show NAME` for all-to-all: the schedule algorithm each name shows
SHOWS = {"pairwise": "pairwise", "bruck": "bruck", "linear": "linear", "hierarchical-a2a": "hierarchical"}

TEXTBOOK = {
    "pairwise": "(p-1)·α + (p-1)/p·n·β   (one block to one peer per step)",
    "linear": "(p-1)·α + (p-1)/p·n·β   (every message posted at once: one round, one port)",
    "bruck": "⌈lg p⌉·α + ⌈lg p⌉·n/2·β   (about half the buffer forwarded each step)",
    "hierarchical": "(L-1)·α + (L-1)/L·n·β inside nodes + (N-1)·α + (N-1)/N·n·β across "
    "(messages L times larger)",
}

Block = tuple[int, int]  # (source rank, destination rank)


@dataclass(frozen=True)
class Message:
    peer: int
    blocks: tuple[Block, ...]
    nbytes: int


@dataclass(frozen=True)
class RankStep:
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]
    output_from: tuple[int, ...]  # sources whose block for this rank it holds (after the step)
    forwarding: tuple[Block, ...]  # other ranks' blocks it holds to pass on


@dataclass(frozen=True)
class Walk:
    schedule: Schedule
    nbytes: int  # per rank buffer
    itemsize: int
    steps: tuple[tuple[RankStep, ...], ...]  # [t][r]

    @property
    def p(self) -> int:
        return self.schedule.world_size


def walk(algorithm: str, p: int, nbytes: int, nodes: int = 1, itemsize: int = 4) -> Walk:
    """The schedule of `p` ranks, each with `nbytes` in p equal blocks, step by step (checked)."""
    if p < 1 or p % nodes:
        raise ValueError(f"--nodes {nodes} must divide --ranks {p}")
    q = Request("all_to_all", algorithm, Topology(p, p // nodes), nbytes // itemsize, itemsize)
    s = build(q)
    dry_run(s)
    holds: list[set[Block]] = [{(r, j) for j in range(p)} for r in range(p)]
    steps = []
    for t in range(s.num_steps):
        per_rank = []
        for r in range(p):
            sends = _messages(s, r, t, OpKind.SEND, itemsize)
            receives = _messages(s, r, t, OpKind.RECV, itemsize)
            for m in receives:
                holds[r].update(m.blocks)
            for m in sends:  # a forwarded block is passed on
                holds[r].difference_update(b for b in m.blocks if b[0] != r)
            output = tuple(sorted(i for i, j in holds[r] if j == r and i != r))
            passing = tuple(sorted(b for b in holds[r] if b[0] != r and b[1] != r))
            per_rank.append(RankStep(sends, receives, output, passing))
        steps.append(tuple(per_rank))
    return Walk(s, nbytes, itemsize, tuple(steps))


def _messages(s: Schedule, r: int, t: int, kind: OpKind, itemsize: int) -> tuple[Message, ...]:
    """One message per peer, as the executor packs them."""
    by_peer: dict[int, list[tuple[Block, int]]] = {}
    for op in s.steps[r][t]:
        if (op.kind is OpKind.SEND) == (kind is OpKind.SEND):
            by_peer.setdefault(op.peer, []).append((_block(s, op.start), op.numel * itemsize))
    return tuple(
        Message(peer, tuple(b for b, _ in items), sum(n for _, n in items)) for peer, items in by_peer.items()
    )


def _block(s: Schedule, start: int) -> Block:
    src, dst = divmod(bisect.bisect_right(s.blocks, start) - 1, s.world_size)
    return src, dst


@dataclass(frozen=True)
class Charge:
    """Steps' messages and busiest-port bytes charged to one link: messages·α + nbytes·β."""

    link: Link
    messages: int
    nbytes: int

    @property
    def seconds(self) -> float:
        return self.messages * self.link.alpha_s + self.nbytes * self.link.beta


def cost(w: Walk, cluster: Cluster) -> tuple[Charge, ...]:
    """Each step: α per message of the rank sending the most, plus the busiest port's bytes·β."""
    local = cluster.gpus_per_node
    charged: dict[str, list[int]] = {}
    links = {cluster.intra.name: cluster.intra, cluster.inter.name: cluster.inter}
    for step in w.steps:
        messages = max(len(rs.sends) for rs in step)
        busiest = max(max(sum(m.nbytes for m in rs.sends), sum(m.nbytes for m in rs.receives)) for rs in step)
        crosses = any(m.peer // local != r // local for r, rs in enumerate(step) for m in rs.sends)
        link = cluster.inter if crosses else cluster.intra
        have = charged.setdefault(link.name, [0, 0])
        have[0] += messages
        have[1] += busiest
    return tuple(Charge(links[name], m, n) for name, (m, n) in charged.items())


def block_text(blocks: Sequence[Block]) -> str:
    return " ".join(f"{i}→{j}" for i, j in blocks)


def moves_text(rs: RankStep) -> list[str]:
    out = [f"→{m.peer}: {block_text(m.blocks)}" for m in rs.sends]
    return out + [f"←{m.peer}: {block_text(m.blocks)}" for m in rs.receives]


def holds_text(rs: RankStep, p: int) -> str:
    have = "all" if len(rs.output_from) == p - 1 else ",".join(map(str, rs.output_from)) or "none"
    text = f"output from {have}"
    if rs.forwarding:
        text += f"; forwards {block_text(rs.forwarding)}"
    return text


def to_json(w: Walk) -> list[dict[str, object]]:
    return [
        {
            "step": t,
            "ranks": [
                {
                    "rank": r,
                    "sends": [{"to": m.peer, "blocks": m.blocks, "bytes": m.nbytes} for m in rs.sends],
                    "receives": [
                        {"from": m.peer, "blocks": m.blocks, "bytes": m.nbytes} for m in rs.receives
                    ],
                    "output_from": rs.output_from,
                    "forwarding": rs.forwarding,
                }
                for r, rs in enumerate(step)
            ],
        }
        for t, step in enumerate(w.steps)
    ]


def frames(w: Walk) -> list[dict[str, object]]:
    """Per step (and the start): held[r][k] = source rank + 1 of block k (ordered by destination,
    then source) if rank r holds it, else 0 (forwarded blocks stay held: they still lie in the
    rank's scratch); the blocks received in the step."""
    p = w.p
    order = [(i, j) for j in range(p) for i in range(p)]
    col = {b: k for k, b in enumerate(order)}
    holds: list[set[Block]] = [{(r, j) for j in range(p)} for r in range(p)]

    def grid() -> list[list[int]]:
        return [[order[k][0] + 1 if order[k] in holds[r] else 0 for k in range(p * p)] for r in range(p)]

    out: list[dict[str, object]] = [
        {"title": "start: every rank its own row", "held": grid(), "received": []}
    ]
    for t, step in enumerate(w.steps):
        received = []
        for r, rs in enumerate(step):
            for m in rs.receives:
                holds[r].update(m.blocks)
                received += [(r, col[b]) for b in m.blocks]
        messages = max(len(rs.sends) for rs in step)
        out.append(
            {
                "title": f"step {t}: {messages} message{'s' if messages > 1 else ''} per rank",
                "held": grid(),
                "received": received,
            }
        )
    return out
