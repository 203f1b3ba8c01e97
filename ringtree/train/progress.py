"""Rank 0's progress bar: steps done, loss and throughput."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressBar:
    """A rich progress bar when enabled, nothing otherwise (the other ranks stay silent)."""

    def __init__(self, enabled: bool, total: int, description: str) -> None:
        self._bar: Progress | None = None
        if enabled:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.0f} samples/s"),
                TimeRemainingColumn(),
                transient=True,
            )
            self._task = self._bar.add_task(description, total=total, loss=float("nan"), rate=0.0)

    def __enter__(self) -> ProgressBar:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, completed: int, loss: float, samples_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, loss=loss, rate=samples_per_s)
