"""Replay of a pipeline schedule in virtual time: per-stage compute costs and link costs give the step.

The rules are the runtime's (ringtree.parallel.pipeline.runtime): a stage runs its actions in
order; an action starts when the stage is free and its receive (if any) has arrived; a send leaves
when its action ends and arrives alpha + bytes / bandwidth later, one message at a time per
direction between two stages. The step ends when the last stage finishes its last action.
Indices: p stages, m micro-batches, j stage, i micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringtree.schedules.pipeline import Action, Kind, PipelineSchedule
from ringtree.sim.network.hardware import Link


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch for each stage's forward and backward, the step, and bytes per transfer."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # the whole backward, B + W
    step_s: float = 0.0
    activation_bytes: int = 0  # one micro-batch's activation (and its gradient) between two stages
    weight_s: tuple[float, ...] = ()  # W of a split backward (B = backward - W); () = half of it

    def __post_init__(self) -> None:
        if len(self.forward_s) != len(self.backward_s):
            raise ValueError(
                f"need one forward and one backward time per stage, got {len(self.forward_s)} and "
                f"{len(self.backward_s)}"
            )
        if min((*self.forward_s, *self.backward_s, self.step_s)) < 0 or self.activation_bytes < 0:
            raise ValueError("compute times and activation bytes must not be negative")
        if self.weight_s and (
            len(self.weight_s) != len(self.backward_s)
            or any(not 0 <= w <= b for w, b in zip(self.weight_s, self.backward_s, strict=True))
        ):
            raise ValueError("need one weight-gradient time per stage, each within its backward's time")

    @classmethod
    def uniform(cls, p: int, forward_s: float, backward_s: float, **kw: float | int) -> StageCosts:
        return cls((forward_s,) * p, (backward_s,) * p, **kw)  # type: ignore[arg-type]

    def duration(self, j: int, a: Action, split: bool = False) -> float:
        """Seconds of action a on stage j; split: the schedule's BACKWARD is B alone, W apart."""
        if a.kind is Kind.FORWARD:
            return self.forward_s[j]
        if a.kind is Kind.BACKWARD:
            return self.backward_s[j] - self.weight(j) if split else self.backward_s[j]
        return self.weight(j) if a.kind is Kind.WEIGHT else self.step_s

    def weight(self, j: int) -> float:
        """W's seconds on stage j: given, or half the backward (a matmul's dX and dW cost the same)."""
        return self.weight_s[j] if self.weight_s else self.backward_s[j] / 2


@dataclass(frozen=True)
class Span:
    """One action of one stage in virtual time."""

    stage: int
    kind: str  # "forward", "backward" (B alone when the schedule splits it), "weight" or "step"
    micro_batch: int
    start: float
    end: float
    chunk: int = 0  # the stage's model chunk (interleaved 1F1B)


@dataclass
class PipelineReplay:
    """The replayed step: its time, every span, and the share of stage time left idle."""

    step_time_s: float
    spans: list[Span] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / (p x step time), counting forwards, backwards and W (not steps) as busy."""
        stages = 1 + max((s.stage for s in self.spans), default=0)
        busy = sum(s.end - s.start for s in self.spans if s.kind != "step")
        return 1.0 - busy / (stages * self.step_time_s) if self.step_time_s > 0 else 0.0


def replay_pipeline(s: PipelineSchedule, costs: StageCosts, link: Link | None = None) -> PipelineReplay:
    """The schedule's step on the given costs; link None: transfers are free, and so is the V
    placement's hand-over between the two chunks of one stage. Several chunks a stage: a chunk's
    forward, backward or W takes 1/V of the stage's (the stage's layers are cut into V chunks)."""
    if len(costs.forward_s) != s.stages:
        raise ValueError(f"the schedule has {s.stages} stages but costs are given for {len(costs.forward_s)}")
    arrived: dict[tuple[str, int, int], float] = {}  # (what, dst, i) -> arrival time
    channel_free: dict[tuple[int, int], float] = {}
    free, done, spans = [0.0] * s.stages, [0] * s.stages, []
    split = s.splits_backward
    while any(done[j] < len(s.actions[j]) for j in range(s.stages)):
        moved = False
        for j in range(s.stages):
            while done[j] < len(s.actions[j]):
                a = s.actions[j][done[j]]
                need = s.recv_of(j, a)
                key = None if need is None else (need.what, need.dst, need.micro_batch)
                if key is not None and key not in arrived:
                    break
                start = max(free[j], 0.0 if key is None else arrived[key])
                share = 1.0 if a.kind is Kind.STEP else 1.0 / s.virtual_stages
                free[j] = start + costs.duration(j, a, split) * share
                spans.append(Span(j, _KINDS[a.kind], a.micro_batch, start, free[j], a.chunk))
                _send(s, j, a, free[j], costs.activation_bytes, link, arrived, channel_free)
                done[j], moved = done[j] + 1, True
        if not moved:
            raise ValueError(
                f"{s.name} deadlocks: run ringtree.schedules.pipeline_verify.dry_run for details"
            )
    return PipelineReplay(max(free), spans)


_KINDS = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.WEIGHT: "weight", Kind.STEP: "step"}


def _send(
    s: PipelineSchedule,
    j: int,
    a: Action,
    end: float,
    nbytes: int,
    link: Link | None,
    arrived: dict[tuple[str, int, int], float],
    channel_free: dict[tuple[int, int], float],
) -> None:
    sent = s.send_of(j, a)
    if sent is None:
        return
    local = s.stage_of(sent.src)[0] == s.stage_of(sent.dst)[0]  # the V's turn: one stage, no link
    cost = 0.0 if link is None or local else link.alpha_s + nbytes * link.beta
    leave = max(end, channel_free.get((sent.src, sent.dst), 0.0))
    channel_free[(sent.src, sent.dst)] = leave + cost
    arrived[(sent.what, sent.dst, sent.micro_batch)] = leave + cost


# The published bubbles, per stage, of one step of m micro-batches with a stage's forward f, input
# gradient b and weight gradient w (a whole backward b + w), equal stages and free transfers. Qi et
# al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 2: 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W),
# ZB-H2 (p-1)(F+B-2W); DeepSeek-V3 (arXiv 2412.19437), Table 2: DualPipe (PP/2-1)(F&B+B-3W) over PP
# chunks, with B the whole backward and F&B an overlapped pair (F+B when nothing overlaps, as here).
FORMULAS = {
    "gpipe": "(p-1)(F+B+W)",
    "1f1b": "(p-1)(F+B+W)",
    "zb-h1": "(p-1)(F+B-W)",
    "zb-h2": "max((p-1)(F+B-2W), (p-1)F)",
    "zb-v": "(p-1)F/2, the fill (all of it at F = B = W)",
    "dualpipev": "(p-1)(F/2+B-W/2) (DeepSeek's, an upper bound here)",
}


def bubble_formula_s(name: str, p: int, f: float, b: float, w: float) -> float:
    """Idle seconds per stage in one synchronous step by the published formula (`FORMULAS`), which
    the replay (`replay_pipeline`) equals for GPipe, 1F1B, ZB-H1 and ZB-H2, and ZB-V at f = b = w.

    ZB-H2's (p-1)(F+B-2W) assumes the optimizer step is not synchronized across stages (Qi et al.'s
    post-validation); one synchronous step cannot start the last stage before the first forward
    reaches it, (p-1) F, hence the max. ZB-V: the fill of (p-1) chunk forwards, (p-1) F/2, is what
    a synchronous step cannot avoid and what it leaves at equal times (their "zero bubble"); other
    times replay to more. DualPipeV: DeepSeek's formula with DualPipeV's PP = 2p chunks (chunk
    forward f/2, whole chunk backward (b+w)/2, chunk W w/2, F&B = F + B), which the replay of the
    pairs one after the other beats."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w)
    if name == "zb-h1":
        return (p - 1) * (f + b - w)
    if name == "zb-h2":
        return max((p - 1) * (f + b - 2 * w), (p - 1) * f)
    if name == "zb-v":
        return (p - 1) * f / 2
    if name == "dualpipev":
        chunk_f, chunk_b, chunk_w = f / 2, (b + w) / 2, w / 2
        return (p - 1) * ((chunk_f + chunk_b) + chunk_b - 3 * chunk_w)
    raise ValueError(f"no bubble formula for {name!r}; choose one of {', '.join(FORMULAS)}")
