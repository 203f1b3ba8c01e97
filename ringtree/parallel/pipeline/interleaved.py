"""The runtime of interleaved 1F1B: one rank runs V model chunks, the virtual stages c p + j.

Each chunk is a PipelineStage of a pipeline of p V virtual stages whose ranks are the real ones
repeated V times (virtual stage s runs on rank s mod p), so its transfers go to the ranks of
virtual stages s - 1 and s + 1, the last rank's chunk c feeding rank 0's chunk c + 1. Two chunks
of a rank may talk to the same neighbour rank, so each link s -> s + 1 keeps its messages apart:
micro-batch i travels under key i + s LINK_KEYS (tags, shared-memory keys) and its own header tag.
The rank then runs its schedule's actions in the interleaved order, each on its chunk's stage.

The V placement (ZB-V, DualPipeV) is the same with two chunks and another map: rank j holds
virtual stages j and 2p-1-j, so virtual stage s runs on rank s (s < p) or 2p-1-s, and the last
rank's two chunks are neighbours: their transfers are handed over in memory (exchange.Loopback).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.comm.errors import CollectiveError
from ringtree.parallel.pipeline.exchange import HEADER_TAG, Aborted, Exchange, Loopback, Shape
from ringtree.parallel.pipeline.runtime import (
    ActionSpan,
    LossFn,
    MicroBatch,
    PipelineStage,
    StageRun,
    _Execution,
)
from ringtree.schedules.pipeline import Kind, PipelineSchedule

LINK_KEYS = 1 << 12  # micro-batch keys per link: runs of up to 4096 micro-batches


class LinkExchange(Exchange):
    """An Exchange whose micro-batch keys and header tags are those of its links (s-1, s) and (s, s+1)."""

    def _link(self, what: str, sending: bool) -> int:
        return min(self.stage, self.peer(what, sending))

    def _key(self, what: str, i: int, sending: bool) -> int:
        return i + LINK_KEYS * self._link(what, sending)

    def start(self, receives: list[tuple[str, int]], sends: list[tuple[str, int]], context: str) -> None:
        super().start(
            [(w, self._key(w, i, False)) for w, i in receives],
            [(w, self._key(w, i, True)) for w, i in sends],
            context,
        )

    def expect(self, what: str, i: int, shape: Shape) -> None:
        super().expect(what, self._key(what, i, False), shape)

    def send(self, what: str, i: int, t: torch.Tensor) -> None:
        super().send(what, self._key(what, i, True), t)

    def recv(self, what: str, i: int) -> torch.Tensor:
        return super().recv(what, self._key(what, i, False))

    def _isend(self, t: torch.Tensor, what: str, tag: int) -> torch.distributed.Work:
        return super()._isend(t, what, self._tag(what, tag, True))

    def _irecv(self, buf: torch.Tensor, what: str, tag: int) -> torch.distributed.Work:
        return super()._irecv(buf, what, self._tag(what, tag, False))

    def _tag(self, what: str, tag: int, sending: bool) -> int:
        """A header tag of this link's own (below the data tags; data tags already differ by key)."""
        if tag != HEADER_TAG[what]:
            return tag
        return HEADER_TAG["activation"] - 2 * (1 + self._link(what, sending)) + int(what == "gradient")


class InterleavedStage:
    """Rank `stage` of a p-rank pipeline holding chunks[c], the virtual stage c p + stage (placement
    "loop"), or stage and 2p-1-stage (placement "v", two chunks)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        stage: int,
        ranks: Sequence[int],
        timeout_s: float = 60.0,
        *,
        loss_fn: LossFn = F.cross_entropy,
        device: torch.device | None = None,
        placement: str = "loop",
        defer_weights: bool = True,
    ) -> None:
        p, v = len(ranks), len(chunks)
        if placement == "v" and v != 2:
            raise ValueError(f"the V placement holds 2 chunks a rank, got {v}")
        shape = PipelineSchedule("", p, 1, ((),) * p, v, placement)  # the map only, no actions
        to_stage, of_stage = shape.stage_of, shape.virtual_of
        virtual = [ranks[to_stage(s)[0]] for s in range(p * v)]  # the rank of each virtual stage
        self.stage, self.p, self.v, self.placement = stage, p, v, placement
        self.chunks = [
            PipelineStage(
                chunk,
                of_stage(stage, c),
                virtual,
                timeout_s,
                loss_fn=loss_fn,
                device=device,
                defer_weights=defer_weights,
            )
            for c, chunk in enumerate(chunks)
        ]
        loopback = Loopback()  # chunks of this rank that are neighbours (the V's turn)
        for st in self.chunks:
            st.exchange = LinkExchange(st.stage, virtual, st.device, timeout_s, loopback)
        # the rank holding the first virtual stage / the last one (the loss)
        self.is_first = to_stage(0)[0] == stage
        self.is_last = to_stage(p * v - 1)[0] == stage

    def run(
        self,
        schedule: PipelineSchedule,
        micro_batches: Sequence[MicroBatch],
        step: Callable[[], None] = lambda: None,
    ) -> StageRun:
        """Run this rank's interleaved actions, each on its chunk; `step` once, at the step action."""
        if (schedule.stages, schedule.virtual_stages, schedule.placement) != (self.p, self.v, self.placement):
            raise ValueError(
                f"schedule for {schedule.stages} stages x {schedule.virtual_stages} chunks placed "
                f"{schedule.placement!r}, but this pipeline has {self.p} stages x {self.v} chunks "
                f"placed {self.placement!r}"
            )
        flat = _flat(schedule)
        runs = [_Execution(st, flat, micro_batches, step) for st in self.chunks]
        try:
            return self._play(schedule, runs, step)
        except Aborted as e:
            for st in self.chunks:
                st.exchange.abort(e.failed, came_from=e.came_from)
            raise CollectiveError(str(e), peer=self.chunks[0].ranks[e.failed]) from None
        except BaseException:
            for st in self.chunks:
                st.exchange.abort(st.stage, came_from=None)
            raise

    def _play(self, schedule: PipelineSchedule, runs: list[_Execution], step: Callable[[], None]) -> StageRun:
        for r in runs:
            r.begin()
        out = StageRun()
        # each action as its chunk's run sees it, made before the first action acts
        actions = [(a, a.chunk, replace(a, chunk=0)) for a in schedule.actions[self.stage]]
        for a, chunk, plain in actions:
            if a.kind is Kind.STEP:
                start = time.perf_counter()
                step()
                out.spans.append(ActionSpan("step", -1, start, time.perf_counter()))
            else:
                runs[chunk].act(plain)
        for r in runs:
            done = r.end()
            out.losses += done.losses
            out.spans += done.spans
            out.peak_activation_bytes += done.peak_activation_bytes  # each chunk's peak: an upper bound
        out.spans.sort(key=lambda s: s.start)
        return out


def _flat(s: PipelineSchedule) -> PipelineSchedule:
    """The same run as a plain pipeline of p V stages: each virtual stage's actions, no step."""
    actions = [
        tuple(replace(a, chunk=0) for a in s.actions[j] if a.kind is not Kind.STEP and a.chunk == c)
        for j, c in (s.stage_of(v) for v in range(s.stages * s.virtual_stages))
    ]
    return PipelineSchedule(s.name, s.stages * s.virtual_stages, s.micro_batches, tuple(actions))
