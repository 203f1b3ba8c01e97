"""The outer synchronisation schedule of local SGD, DiLoCo and Streaming DiLoCo, as data (no torch).

Words, used the same way everywhere:
  H  sync_every: inner steps between two synchronisations of the same fragment
  F  fragments: the model's layers split into F groups that synchronise one at a time
  T  overlap_steps: inner steps during which a fragment's outer all-reduce runs in the background
  t  the inner-step counter, counted after each inner optimizer step (1, 2, ...)
Fragment sync k (k = 1, 2, ...) is fragment (k - 1) mod F; it sends its pseudo-gradient after inner
step k H/F - T and applies the outer step after inner step k H/F. So one fragment synchronises
every H/F steps, each fragment every H steps, and with F = 1, T = 0 this is DiLoCo's every H steps.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("strided", "contiguous")


@dataclass(frozen=True)
class OuterSync:
    """One fragment's synchronisation: sent after inner step `start`, applied after inner step `end`."""

    index: int  # k - 1: which synchronisation this is (0, 1, ...)
    fragment: int
    start: int
    end: int


@dataclass(frozen=True)
class OuterSchedule:
    """When each fragment synchronises (see the module's words)."""

    sync_every: int
    fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        check(self.sync_every, self.fragments, self.overlap_steps)

    @property
    def period(self) -> int:
        """H / F: inner steps between two fragment synchronisations."""
        return self.sync_every // self.fragments

    def starting(self, t: int) -> OuterSync | None:
        """The synchronisation whose all-reduce starts after inner step t, if any."""
        return self._sync(t + self.overlap_steps) if t + self.overlap_steps >= self.period else None

    def ending(self, t: int) -> OuterSync | None:
        """The synchronisation whose outer step is applied after inner step t, if any."""
        return self._sync(t)

    def _sync(self, end: int) -> OuterSync | None:
        if end < self.period or end % self.period:
            return None
        k = end // self.period
        return OuterSync(k - 1, (k - 1) % self.fragments, end - self.overlap_steps, end)

    def syncs(self, steps: int) -> list[OuterSync]:
        """Every synchronisation that completes within `steps` inner steps."""
        return [
            OuterSync(k - 1, (k - 1) % self.fragments, k * self.period - self.overlap_steps, k * self.period)
            for k in range(1, steps // self.period + 1)
        ]

    def completed(self, steps: int) -> int:
        """How many synchronisations have been applied after `steps` inner steps."""
        return steps // self.period


def check(sync_every: int, fragments: int, overlap_steps: int, layers: int | None = None) -> None:
    """ValueError naming the value at fault, and the fix."""
    if sync_every < 1:
        raise ValueError(f"sync_every (--inner-steps) must be at least 1, got {sync_every}")
    if fragments < 1:
        raise ValueError(f"fragments (--fragments) must be at least 1, got {fragments}")
    if layers is not None and fragments > layers:
        raise ValueError(
            f"fragments (--fragments) {fragments} is more than the model's {layers} layers; "
            f"use --fragments {layers} or fewer"
        )
    if sync_every % fragments:
        raise ValueError(
            f"fragments (--fragments) {fragments} must divide sync_every (--inner-steps) {sync_every}, "
            "so that every fragment synchronises every H steps"
        )
    if not 0 <= overlap_steps < sync_every // fragments:
        raise ValueError(
            f"overlap_steps (--overlap-steps) must be in [0, H/F) = [0, {sync_every // fragments}), "
            f"got {overlap_steps}: a fragment's all-reduce must end before the next one starts"
        )


def split_layers(layers: int, fragments: int, layout: str = "strided") -> list[list[int]]:
    """Layer indices of each fragment: strided (f, f + F, ...) or contiguous (blocks in order)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown fragment layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    check(fragments, fragments, 0, layers)
    if layout == "strided":
        return [list(range(f, layers, fragments)) for f in range(fragments)]
    bounds = [layers * f // fragments for f in range(fragments + 1)]
    return [list(range(bounds[f], bounds[f + 1])) for f in range(fragments)]
