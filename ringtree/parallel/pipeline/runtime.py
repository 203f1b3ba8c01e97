"""The pipeline runtime: one stage runs its schedule's actions with torch.distributed point-to-point.

Indices: p stages, m micro-batches, j stage (this rank's), i micro-batch. Activations go forward
and gradients backward through `exchange.Exchange`: receives are posted at the start of the run,
sends never block and are awaited at the end of the schedule, receives wait at most timeout_s
(docs/pipeline.md shows the timeline). Tensors live on the stage's device (its parameters'). The
last stage computes `loss_fn(output, labels)`; losses stay on the device until the run ends. A
stage that fails sends an abort header to its neighbours, which raise and pass it on, so a failure
in one stage raises on every stage instead of leaving the others waiting.

Schedules that split the backward (ZB-H1, ZB-H2, ZB-V, DualPipeV) run B and W as two actions
(`split`): B computes the input's gradient and sends it upstream at once, W the weights' gradients
when the schedule says; a micro-batch's activations are held until its W. Their weight gradients
are added into `.grad` outside the parameters' hooks, so DDP synchronizes them at the step. A stage
made with defer_weights=False (activation-checkpointed: deferring W would recompute its segments
once per weight) computes the weight gradients in B and its W actions do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.comm.errors import CollectiveError
from ringtree.parallel.pipeline.exchange import Aborted, Exchange
from ringtree.parallel.pipeline.split import SplitCache, WeightWork, backward_input, backward_weight
from ringtree.parallel.pipeline.stash import WeightStash
from ringtree.schedules.pipeline import SYNCHRONOUS, Action, Kind, PipelineSchedule

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, labels) -> mean loss


@dataclass(frozen=True)
class ActionSpan:
    """One forward, backward (B of a split one), weight (its W) or step of this stage, in
    time.perf_counter() seconds."""

    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass
class StageRun:
    """What one run of a schedule did on this stage."""

    losses: list[float] = field(default_factory=list)  # last stage: each micro-batch's loss
    spans: list[ActionSpan] = field(default_factory=list)
    peak_activation_bytes: int = 0  # tensors saved for backward by the micro-batches in flight
    peak_versions: int = 1  # weight versions held at once (PipeDream)


class PipelineStage:
    """This rank's stage of a pipeline whose stage j runs on global rank ranks[j].

    The last stage turns its output and the micro-batch's targets into the loss with `loss_fn`.
    defer_weights: under a schedule that splits the backward, W computes the weight gradients
    (False: B does, with the input's; for a stage under activation checkpointing).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        ranks: Sequence[int],
        timeout_s: float = 60.0,
        *,
        loss_fn: LossFn = F.cross_entropy,
        device: torch.device | None = None,
        defer_weights: bool = True,
    ) -> None:
        if not 0 <= stage < len(ranks):
            raise ValueError(f"stage {stage} is not one of the {len(ranks)} stages of ranks {list(ranks)}")
        self.module, self.stage, self.ranks, self.timeout_s = module, stage, list(ranks), timeout_s
        self.is_first, self.is_last = stage == 0, stage == len(ranks) - 1
        self.loss_fn, self.defer_weights = loss_fn, defer_weights
        first = next(module.parameters(), None)
        self.device = device or (first.device if first is not None else torch.device("cpu"))
        self.exchange = Exchange(stage, self.ranks, self.device, timeout_s)
        self.split_cache = SplitCache()  # B's graph analysis, by graph shape: once per shape, not per B

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
        except Aborted as e:
            self.exchange.abort(e.failed, came_from=e.came_from)
            raise CollectiveError(str(e), peer=self.ranks[e.failed]) from None
        except BaseException:
            self.exchange.abort(self.stage, came_from=None)
            raise


class _Execution:
    """The state of one run: saved tensors per micro-batch in flight, losses, spans."""

    def __init__(
        self,
        stage: PipelineStage,
        s: PipelineSchedule,
        batches: Sequence[MicroBatch],
        step: Callable[[], None],
    ) -> None:
        self.st, self.s, self.batches, self.step = stage, s, batches, step
        self.ex = stage.exchange
        total = sum(len(y) for _, y in batches)
        # Synchronous schedules accumulate one step's gradient: each micro-batch's mean loss by its share.
        self.scale = [len(y) / total if s.name in SYNCHRONOUS else 1.0 for _, y in batches]
        self.stash = None if s.name in SYNCHRONOUS else WeightStash(stage.module, s.actions[stage.stage])
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i -> (input, output or loss)
        self.split = s.splits_backward
        self.weight_work: dict[int, WeightWork] = {}  # i -> what its W needs (split backward)
        self.saved_bytes: dict[int, int] = {}
        self.losses: list[torch.Tensor] = []  # detached, on the device: read once, at the end
        self.out = StageRun()
        # the weights' storages, once per run (not per forward: between actions every tensor
        # operation counts, and an optimizer step updates the weights in place)
        self.params = {p.untyped_storage().data_ptr() for p in stage.module.parameters()}
        self.act_of = {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.WEIGHT: self.weight,
            Kind.STEP: self.do_step,
        }
        self.times: list[tuple[str, int, float, float]] = []  # the spans, as tuples until the run ends

    def run(self) -> StageRun:
        self.begin()
        for a in self.s.actions[self.st.stage]:
            self.act(a)
        return self.end()

    def begin(self) -> None:
        """Post the run's receives (interleaved 1F1B: each chunk's, before any chunk acts)."""
        j = self.st.stage
        receives = [self.s.recv_of(j, a) for a in self.s.actions[j]]
        sends = [self.s.send_of(j, a) for a in self.s.actions[j]]
        self.ex.start(
            [(r.what, r.micro_batch) for r in receives if r is not None],
            [(t.what, t.micro_batch) for t in sends if t is not None],
            self.s.name,
        )

    def act(self, a: Action) -> None:
        self.act_of[a.kind](a)

    def end(self) -> StageRun:
        """Wait for the run's sends; the losses read once."""
        self.ex.finish()
        self.out.spans = [ActionSpan(*t) for t in self.times]
        if self.losses:
            self.out.losses = [float(v) for v in torch.stack(self.losses).tolist()]
        if self.stash is not None:
            self.out.peak_versions = self.stash.peak_versions
        return self.out

    def forward(self, a: Action) -> None:
        i = a.micro_batch
        x = self._input(i)
        start = time.perf_counter()
        params = self.params if self.stash is None else self.params | self.stash.storages(a.version)
        counted: set[int] = set()
        self.saved_bytes[i] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in counted:  # activations only, not weights
                counted.add(ptr)
                self.saved_bytes[i] += t.untyped_storage().nbytes()
            # not t: a node saving its own output would hold it, its grad_fn the node, a cycle that
            # outlives the graph (a split backward's B retains what only dropping the graph frees)
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.st.module(x) if self.stash is None else self.stash.forward(i, a.version, x)
            if self.st.is_last:
                loss = self.st.loss_fn(out, self.batches[i][1].to(self.st.device, non_blocking=True))
                self.losses.append(loss.detach())
                out = loss * self.scale[i]
        self.out.peak_activation_bytes = max(self.out.peak_activation_bytes, sum(self.saved_bytes.values()))
        self.saved[i] = (x, out)
        self.span("forward", i, start)
        if not self.st.is_last:
            self.ex.send("activation", i, out)
            self.ex.expect("gradient", i, (tuple(out.shape), out.dtype))  # its gradient's receive, early

    def _input(self, i: int) -> torch.Tensor:
        if self.st.is_first:
            x = self.batches[i][0]
            return x if x.device == self.st.device else x.to(self.st.device, non_blocking=True)
        return self.ex.recv("activation", i).requires_grad_()

    def backward(self, a: Action) -> None:
        i = a.micro_batch
        x, out = self.saved.pop(i)
        grad = None if self.st.is_last else self.ex.recv("gradient", i)
        start = time.perf_counter()
        if self.split:  # B: the input's gradient only; W later
            self.weight_work[i] = backward_input(out, grad, x, self.st.defer_weights, self.st.split_cache)
            del out
            self.span("backward", i, start)
            if not self.st.is_first:
                assert x.grad is not None, "a received activation always requires grad"
                self.ex.send("gradient", i, x.grad)
            return
        torch.autograd.backward(out, grad)
        del self.saved_bytes[i]
        if self.stash is not None:
            self.stash.backward_done(i)
        self.span("backward", i, start)
        if not self.st.is_first:
            assert x.grad is not None, "a received activation always requires grad"
            self.ex.send("gradient", i, x.grad)

    def weight(self, a: Action) -> None:
        """W of micro-batch i: its weights' gradients, into .grad; its activations freed."""
        i = a.micro_batch
        start = time.perf_counter()
        backward_weight(self.weight_work.pop(i))
        del self.saved_bytes[i]
        self.span("weight", i, start)

    def do_step(self, a: Action) -> None:
        start = time.perf_counter()
        self.step()
        if self.stash is not None:
            self.stash.stepped()
        self.span("step", a.micro_batch, start)

    def span(self, kind: str, i: int, start: float) -> None:
        self.times.append((kind, i, start, time.perf_counter()))  # made ActionSpans by end()
