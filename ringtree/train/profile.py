"""`--profile DIR`: a torch.profiler trace of optimizer steps FIRST..LAST, one file per rank
(DIR/rank{R}.json.gz, Kineto's Chrome trace with its distributedInfo), for `ringtree trace DIR`.

Each profiled optimizer step is one `ProfilerStep#N` (N: the step's number); after the last one a
step is opened and closed at once, so that `ringtree trace`'s default (every step but the last,
as Holistic Trace Analysis) covers FIRST..LAST. CPU activity always, CUDA's on a GPU; shapes are
recorded (a gloo collective's size is its input's) and every thread is profiled (ringtree's
communication thread too).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def parse_steps(text: str) -> tuple[int, int]:
    """'2:5' -> (2, 5); ValueError naming the flag otherwise."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a, b = -1, -1
    if not sep or a < 0 or b < a:
        raise ValueError(f"--profile-steps {text!r}: write FIRST:LAST with 0 <= FIRST <= LAST, e.g. 2:5")
    return a, b


class StepProfiler:
    """Starts torch.profiler before step FIRST, marks each step, writes the trace after LAST."""

    def __init__(self, folder: str | None, steps: str, rank: int, device: torch.device) -> None:
        self.folder = Path(folder) if folder else None
        self.first, self.last = parse_steps(steps)
        self.rank, self.device = rank, device
        self.prof: Any = None
        self.written: Path | None = None

    def before(self, step: int) -> None:
        """Called before the optimizer step numbered `step` runs."""
        if self.folder is None or self.prof is not None or self.written or step < self.first:
            return
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(
            activities=activities,
            schedule=lambda _step: ProfilerAction.RECORD,  # a schedule: each step() marks a step
            record_shapes=True,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        self.prof.step_num = step  # ProfilerStep#N carries the optimizer step's number
        self.prof.start()

    def after(self, done: int) -> None:
        """Called when `done` optimizer steps have run."""
        if self.prof is None:
            return
        self.prof.step()  # closes ProfilerStep#(done - 1), opens the next
        if done - 1 >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (atomically); also at the end of a run shorter than LAST."""
        if self.prof is None or self.folder is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"rank{self.rank}.json.gz"
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{target.name}.", suffix=".json.gz")
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)  # a new file's ordinary permissions (mkstemp's are private)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        self.written = target
