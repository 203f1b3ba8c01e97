"""A pipeline schedule on a clock: what each stage does in every time slot, its bubble and its memory.

p stages, m micro-batches, j stage, i micro-batch, k a time slot. A forward takes one slot and a
backward two (the usual 1:2 ratio, as `ringtree.sim.training.plan.predict_pipeline` assumes); a split
backward is B (input gradient) and W (weight gradient), one slot each (a matmul's two gradients cost
the same); transfers are free. Several chunks a stage: each chunk's forward is one slot. The slots
come from the simulator's replay of the schedule, so what is drawn is what `ringtree sim` and the
runtime play.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtree.schedules.pipeline import (
    SCHEDULES,
    ZERO_BUBBLE,
    Kind,
    PipelineSchedule,
    build,
    theoretical_bubble_fraction,
)
from ringtree.schedules.pipeline_verify import peak_in_flight, peak_versions, staleness
from ringtree.sim.training.pipeline import PipelineReplay, StageCosts, bubble_formula_s, replay_pipeline

FORWARD_SLOTS, BACKWARD_SLOTS = 1, 2
PIPELINES = tuple(SCHEDULES)
_KINDS = {"forward": Kind.FORWARD, "backward": Kind.BACKWARD, "weight": Kind.WEIGHT}


@dataclass(frozen=True)
class Slot:
    """What stage j does in one slot: 'forward', 'backward' (B alone when the schedule splits it),
    'weight' (W) or 'idle', of micro-batch i with weights v, in chunk c."""

    op: str
    micro_batch: int = -1
    version: int = 0
    chunk: int = 0


@dataclass(frozen=True)
class Timeline:
    """The schedule, its replay on the slot clock, and the slots of every stage."""

    schedule: PipelineSchedule
    replay: PipelineReplay
    slots: tuple[tuple[Slot, ...], ...]  # [j][k]

    @property
    def bubble_fraction(self) -> float:
        return self.replay.bubble_fraction

    @property
    def theoretical_bubble_fraction(self) -> float:
        """The formula's: (p-1)/(v m+p-1), or for the zero-bubble schedules their published bubble
        (`ringtree.sim.training.pipeline.bubble_formula_s`) on the slot clock."""
        s = self.schedule
        if s.name not in ZERO_BUBBLE:
            return theoretical_bubble_fraction(s.stages, s.micro_batches, s.virtual_stages)
        v = float(s.virtual_stages)  # a stage's F, B and W: v slots each
        idle = bubble_formula_s(s.name, s.stages, v, v, v)
        return idle / (3 * v * s.micro_batches + idle)

    def in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose activations it keeps for their backward."""
        return [peak_in_flight(self.schedule, j) for j in range(self.schedule.stages)]

    def versions(self) -> list[int]:
        """Per stage, the most weight versions it holds at once (1 for the synchronous schedules)."""
        return [peak_versions(self.schedule, j) for j in range(self.schedule.stages)]

    def staleness(self) -> list[list[int]]:
        return [staleness(self.schedule, j) for j in range(self.schedule.stages)]

    def forward_versions(self) -> list[list[int]]:
        """[j][i]: the weight version stage j's forward of micro-batch i uses."""
        out = []
        for actions in self.schedule.actions:
            by_i = {a.micro_batch: a.version for a in actions if a.kind is Kind.FORWARD}
            out.append([by_i[i] for i in range(self.schedule.micro_batches)])
        return out


def timeline(name: str, p: int, m: int, v: int = 1) -> Timeline:
    """The schedule called `name` for p stages and m micro-batches (v chunks a stage), on the slot
    clock: a forward of one chunk takes one slot, its backward two."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not 1 <= p <= 64 or not 1 <= m <= 256:
        raise ValueError(f"--stages must be 1..64 and --micro-batches 1..256, got {p} and {m}")
    if not 1 <= v <= 16:
        raise ValueError(f"--virtual-stages must be 1..16, got {v}")
    s = build(name, p, m, v)
    v = s.virtual_stages  # the V schedules hold two chunks a stage whatever was asked
    replay = replay_pipeline(s, StageCosts.uniform(p, float(FORWARD_SLOTS * v), float(BACKWARD_SLOTS * v)))
    versions = {(j, a.micro_batch, a.kind): a.version for j, acts in enumerate(s.actions) for a in acts}
    slots = [[Slot("idle")] * round(replay.step_time_s) for _ in range(p)]
    for span in replay.spans:
        if span.kind == "step":
            continue
        kind = _KINDS[span.kind]
        slot = Slot(span.kind, span.micro_batch, versions[(span.stage, span.micro_batch, kind)], span.chunk)
        for k in range(round(span.start), round(span.end)):
            slots[span.stage][k] = slot
    return Timeline(s, replay, tuple(tuple(row) for row in slots))


def to_json(t: Timeline) -> list[dict[str, Any]]:
    """One entry per time slot: what every stage does in it."""
    out = []
    for k in range(len(t.slots[0]) if t.slots else 0):
        stages = []
        for j, row in enumerate(t.slots):
            slot = row[k]
            entry: dict[str, Any] = {"stage": j, "op": slot.op}
            if slot.op != "idle":
                entry |= {"micro_batch": slot.micro_batch, "version": slot.version}
                if t.schedule.virtual_stages > 1:
                    entry["chunk"] = slot.chunk
            stages.append(entry)
        out.append({"step": k, "stages": stages})
    return out


def gantt_spans(t: Timeline, with_versions: bool) -> list[dict[str, Any]]:
    """Spans for `ringtree.plots.plot_gantt`: one slot drawn as 1 ms; labels 'i' or 'i/vV'."""
    spans = []
    for s in t.replay.spans:
        if s.kind == "step":
            continue
        kind = _KINDS[s.kind]
        label: int | str = s.micro_batch if t.schedule.virtual_stages == 1 else f"{s.micro_batch}.{s.chunk}"
        if with_versions:
            v = next(
                a.version
                for a in t.schedule.actions[s.stage]
                if a.kind is kind and a.micro_batch == s.micro_batch
            )
            label = f"{s.micro_batch}/v{v}"
        spans.append(
            {
                "stage": s.stage,
                "kind": s.kind,
                "micro_batch": label,
                "start": s.start * 1e-3,
                "end": s.end * 1e-3,
            }
        )
    return spans
