"""DiLoCo's timeline as data: each replica's inner steps, which fragment synchronises when, and
what the outer all-reduce overlaps (from ringtree.schedules.outer, the schedule the trainer runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtree.schedules.outer import OuterSchedule, OuterSync, check


@dataclass(frozen=True)
class Step:
    """Inner step t (1-based) on every replica, and the outer work around it."""

    step: int
    sends: list[int]  # fragments whose pseudo-gradient is sent after this step
    in_flight: list[int]  # fragments whose outer all-reduce runs during this step
    applies: list[int]  # fragments whose outer step is applied after this step


@dataclass(frozen=True)
class Timeline:
    replicas: int
    schedule: OuterSchedule
    steps: list[Step]
    syncs: list[OuterSync]

    @property
    def overlapped_fraction(self) -> float:
        """The share of outer all-reduces that run behind inner steps (all of them when T > 0)."""
        return 1.0 if self.schedule.overlap_steps else 0.0


def default_inner_steps(fragments: int, overlap_steps: int) -> int:
    """H when --inner-steps is not given: H/F = max(4, T + 1) steps between fragment syncs."""
    return fragments * max(4, overlap_steps + 1)


def timeline(
    replicas: int, fragments: int, overlap_steps: int, inner_steps: int, rounds: int = 2
) -> Timeline:
    """`rounds` x H inner steps of R replicas; ValueError naming the option for a bad value."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    check(inner_steps, fragments, overlap_steps)
    schedule = OuterSchedule(inner_steps, fragments, overlap_steps)
    syncs = schedule.syncs(rounds * inner_steps)
    steps = [
        Step(
            t,
            [s.fragment for s in syncs if s.start == t],
            [s.fragment for s in syncs if s.start < t <= s.end],
            [s.fragment for s in syncs if s.end == t],
        )
        for t in range(1, rounds * inner_steps + 1)
    ]
    return Timeline(replicas, schedule, steps, syncs)


def outer_cell(step: Step, t: Timeline) -> str:
    """What crosses between the replicas around one inner step, in words."""
    parts = [f"f{f} all-reduce in flight" for f in step.in_flight]
    for f in step.sends:
        verb = "starts (background)" if t.schedule.overlap_steps else "average (blocking)"
        parts.append(f"f{f} send Δ = global - local: {verb}")
    for f in step.applies:
        parts.append(f"f{f} outer step, merge" if t.schedule.overlap_steps else f"f{f} outer step")
    return "; ".join(parts) or "-"


def to_json(t: Timeline) -> dict[str, Any]:
    s = t.schedule
    return {
        "replicas": t.replicas,
        "inner_steps": s.sync_every,
        "fragments": s.fragments,
        "overlap_steps": s.overlap_steps,
        "steps_between_syncs": s.period,
        "bytes_per_sync": 1 / s.fragments,
        "syncs": [{"fragment": x.fragment, "sent_after": x.start, "applied_after": x.end} for x in t.syncs],
        "steps": [
            {"step": x.step, "sends": x.sends, "in_flight": x.in_flight, "applies": x.applies}
            for x in t.steps
        ],
    }


def plot(t: Timeline, path: Path, title: str) -> None:
    """One row per replica (inner steps), one for the link between them (fragment all-reduces)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(11, 0.55 * (t.replicas + 1) + 1.8))
    for r in range(t.replicas):
        for x in t.steps:
            ax.barh(r, 1, left=x.step - 1, color="tab:gray", edgecolor="black", lw=0.4)
            ax.text(x.step - 0.5, r, str(x.step), ha="center", va="center", fontsize=7, color="white")
    link = t.replicas
    for sync in t.syncs:
        width = max(sync.end - sync.start, 0.25)  # T = 0: a blocking average, drawn thin at the step's end
        colour = colours((sync.fragment + 1) % 10)
        ax.barh(link, width, left=sync.start, color=colour, edgecolor="black", lw=0.4)
        ax.text(sync.start + width / 2, link, f"f{sync.fragment}", ha="center", va="center", fontsize=7)
    ax.set_yticks([*range(t.replicas), link], [*(f"replica {r}" for r in range(t.replicas)), "outer link"])
    ax.invert_yaxis()
    ax.set_xlabel("inner steps")
    handles = [Patch(color="tab:gray", label="inner step")]
    handles += [
        Patch(color=colours((f + 1) % 10), label=f"fragment {f} all-reduce")
        for f in range(t.schedule.fragments)
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(handles))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
