"""The pipeline runtime: one stage runs its schedule's actions with torch.distributed point-to-point.

Indices: p stages, m micro-batches, j stage (this rank's), i micro-batch. Activations go forward
and gradients backward as a fixed-size header (shape and dtype) followed by the data; sends are
non-blocking and awaited at the end of the schedule, receives wait at most timeout_s. A stage that
fails sends an abort header to its neighbours, which raise and pass it on, so a failure in one
stage raises on every stage instead of leaving the others waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree.comm.errors import CollectiveError
from ringtree.parallel.pipeline.stash import WeightStash
from ringtree.schedules.pipeline import SYNCHRONOUS, Action, Kind, PipelineSchedule

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, targets) -> mean loss
HEADER = 8  # int64 slots: ndim (or ABORT), up to 6 sizes, dtype code
ABORT = -1
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ABORT_WAIT_S = 2.0  # how long a failing stage waits for its abort messages to leave


@dataclass(frozen=True)
class ActionSpan:
    """One forward, backward or step of this stage, in time.perf_counter() seconds."""

    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass
class StageRun:
    """What one run of a schedule did on this stage."""

    losses: list[torch.Tensor] = field(default_factory=list)  # last stage: each micro-batch's loss (0-d)
    spans: list[ActionSpan] = field(default_factory=list)
    peak_activation_bytes: int = 0  # tensors saved for backward by the micro-batches in flight
    peak_versions: int = 1  # weight versions held at once (PipeDream)


class PipelineStage:
    """This rank's stage of a pipeline whose stage j runs on global rank ranks[j].

    The last stage turns its output and the micro-batch's targets into the loss with `loss_fn`.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        ranks: Sequence[int],
        timeout_s: float = 60.0,
        loss_fn: LossFn = F.cross_entropy,
    ) -> None:
        if not 0 <= stage < len(ranks):
            raise ValueError(f"stage {stage} is not one of the {len(ranks)} stages of ranks {list(ranks)}")
        self.module, self.stage, self.ranks, self.timeout_s = module, stage, list(ranks), timeout_s
        self.loss_fn = loss_fn
        self.is_first, self.is_last = stage == 0, stage == len(ranks) - 1

    def run(
        self,
        schedule: PipelineSchedule,
        micro_batches: Sequence[MicroBatch],
        step: Callable[[], None] = lambda: None,
    ) -> StageRun:
        """Run this stage's actions on the micro-batches; `step` is called for every step action."""
        if schedule.stages != len(self.ranks) or schedule.micro_batches != len(micro_batches):
            raise ValueError(
                f"schedule for {schedule.stages} stages and {schedule.micro_batches} micro-batches, but the "
                f"pipeline has {len(self.ranks)} stages and {len(micro_batches)} micro-batches were given"
            )
        execution = _Execution(self, schedule, micro_batches, step)
        try:
            return execution.run()
        except _Aborted as e:
            execution.abort(e.failed, came_from=e.came_from)
            raise CollectiveError(str(e), peer=self.ranks[e.failed]) from None
        except BaseException:
            execution.abort(self.stage, came_from=None)
            raise


class _Aborted(Exception):
    def __init__(self, message: str, failed: int, came_from: int) -> None:
        super().__init__(message)
        self.failed, self.came_from = failed, came_from


class _Execution:
    """The state of one run: saved tensors per micro-batch in flight, pending sends, spans."""

    def __init__(
        self,
        stage: PipelineStage,
        s: PipelineSchedule,
        batches: Sequence[MicroBatch],
        step: Callable[[], None],
    ) -> None:
        self.st, self.s, self.batches, self.step = stage, s, batches, step
        total = sum(len(y) for _, y in batches)
        # Synchronous schedules accumulate one step's gradient: each micro-batch's mean loss by its share.
        self.scale = [len(y) / total if s.name in SYNCHRONOUS else 1.0 for _, y in batches]
        self.stash = None if s.name in SYNCHRONOUS else WeightStash(stage.module, s.actions[stage.stage])
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i -> (input, output or loss)
        self.saved_bytes: dict[int, int] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.out = StageRun()

    def run(self) -> StageRun:
        for a in self.s.actions[self.st.stage]:
            {Kind.FORWARD: self.forward, Kind.BACKWARD: self.backward, Kind.STEP: self.do_step}[a.kind](a)
        for work, _ in self.sends:
            self.wait(work, "send", -1)
        self.sends.clear()
        if self.stash is not None:
            self.out.peak_versions = self.stash.peak_versions
        return self.out

    def forward(self, a: Action) -> None:
        i = a.micro_batch
        x = self.batches[i][0] if self.st.is_first else self.recv("activation", i).requires_grad_()
        start = time.perf_counter()
        params = {p.untyped_storage().data_ptr() for p in self.st.module.parameters()}
        if self.stash is not None:
            params |= self.stash.storages(a.version)
        counted: set[int] = set()
        self.saved_bytes[i] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in counted:  # activations only, not weights
                counted.add(ptr)
                self.saved_bytes[i] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.st.module(x) if self.stash is None else self.stash.forward(i, a.version, x)
            if self.st.is_last:
                loss = self.st.loss_fn(out, self.batches[i][1])
                self.out.losses.append(loss.detach())  # stays on the device: no host sync per micro-batch
                out = loss * self.scale[i]
        self.out.peak_activation_bytes = max(self.out.peak_activation_bytes, sum(self.saved_bytes.values()))
        self.saved[i] = (x, out)
        self.span("forward", i, start)
        if not self.st.is_last:
            self.send(out.detach(), self.st.stage + 1)

    def backward(self, a: Action) -> None:
        i = a.micro_batch
        x, out = self.saved.pop(i)
        grad = None if self.st.is_last else self.recv("gradient", i)
        start = time.perf_counter()
        torch.autograd.backward(out, grad)
        del self.saved_bytes[i]
        if self.stash is not None:
            self.stash.backward_done(i)
        self.span("backward", i, start)
        if not self.st.is_first:
            assert x.grad is not None, "a received activation always requires grad"
            self.send(x.grad, self.st.stage - 1)

    def do_step(self, a: Action) -> None:
        start = time.perf_counter()
        self.step()
        if self.stash is not None:
            self.stash.stepped()
        self.span("step", a.micro_batch, start)

    def span(self, kind: str, i: int, start: float) -> None:
        self.out.spans.append(ActionSpan(kind, i, start, time.perf_counter()))

    def send(self, t: torch.Tensor, stage: int) -> None:
        t = t.contiguous()
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[-1] = t.dim(), DTYPES.index(t.dtype)
        header[1 : 1 + t.dim()] = torch.tensor(t.shape)
        for part in (header, t):
            work = dist.isend(part, self.st.ranks[stage])
            assert work is not None, "isend to another rank returns a Work"
            self.sends.append((work, part))

    def recv(self, what: str, i: int) -> torch.Tensor:
        peer = self.st.stage + (-1 if what == "activation" else 1)
        header = torch.zeros(HEADER, dtype=torch.int64)
        self.wait(dist.irecv(header, self.st.ranks[peer]), f"the header of the {what}", i)
        if int(header[0]) == ABORT:
            failed = int(header[1])
            raise _Aborted(
                f"pipeline stage {self.st.stage} (rank {self.st.ranks[self.st.stage]}) stops: stage "
                f"{failed} (rank {self.st.ranks[failed]}) failed; see that rank's error",
                failed,
                peer,
            )
        ndim = int(header[0])
        t = torch.empty([int(d) for d in header[1 : 1 + ndim]], dtype=DTYPES[int(header[-1])])
        self.wait(dist.irecv(t, self.st.ranks[peer]), f"the {what}", i)
        return t

    def wait(self, work: dist.Work | None, what: str, i: int) -> None:
        assert work is not None, "point-to-point with another rank returns a Work"
        try:
            work.wait(timeout=timedelta(seconds=self.st.timeout_s))
        except RuntimeError as e:
            raise CollectiveError(
                f"pipeline stage {self.st.stage} (rank {self.st.ranks[self.st.stage]}) could not complete "
                f"{what} of micro-batch {i} within {self.st.timeout_s:.0f}s ({self.s.name} schedule): a "
                f"neighbouring stage failed or is stuck ({e})"
            ) from None

    def abort(self, failed: int, came_from: int | None) -> None:
        """Tell the neighbouring stages (but the one the abort came from) that stage `failed` failed."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1] = ABORT, failed
        works = []
        for peer in (self.st.stage - 1, self.st.stage + 1):
            if 0 <= peer < len(self.st.ranks) and peer != came_from:
                works.append(dist.isend(header.clone(), self.st.ranks[peer]))
        for work in works:
            try:
                if work is not None:
                    work.wait(timeout=timedelta(seconds=ABORT_WAIT_S))
            except RuntimeError:
                pass  # the neighbour is gone or stuck itself; its own timeout covers it
