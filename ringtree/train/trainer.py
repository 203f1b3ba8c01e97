"""One trainer for every parallelism: DP x TP x PP composed from one TrainConfig, on any device.

The world is a Mesh: tensor-parallel groups innermost (adjacent ranks, one node), then pipeline
stages, then data-parallel replicas. Each rank builds the model and hands it to `parallelize`
(ringtree.train.parallelize), which shards it over its TP group (--tp), checkpoints activations,
keeps its pipeline stage (--pp), and wraps what it trains in ringtree's DistributedDataParallel
or ShardedDataParallel (--zero) over its DP group, so every DP option (algorithm, buckets,
overlap, compression, accumulation, checkpoints) works in every layout. The trainer runs the loop
and owns checkpoints, metrics and the summary. Without --pp a step is the seeds' flow: forward,
backward (the last micro-batch synchronizing), AdamW; with --pp the pipeline runtime runs the
schedule and the step. The master-rank `--mode dp` replaces DDP when asked. Under `--sync
local-sgd|diloco|streaming-diloco` the DDP runs inside replica groups and ringtree.train.low_comm
hooks the optimizer's step with the outer synchronisation across them.

Losses and metrics stay on the device during the loop; the host reads them once per log
interval (the progress bar) and once at the end (the summary).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ringtree.parallel import DistributedDataParallel, MasterDataParallel, Mesh, ShardedDataParallel
from ringtree.parallel.dp_threads import ThreadedDataParallel
from ringtree.parallel.moe import CLOCK as A2A_CLOCK
from ringtree.parallel.pipeline.runtime import MicroBatch, StageRun
from ringtree.processes import (
    default_backend,
    init_from_env,
    restart_count,
    training_started,
    under_torchrun,
)
from ringtree.schedules.pipeline import MIN_MICRO_BATCHES_PER_STAGE, SYNCHRONOUS, ZERO_BUBBLE, build
from ringtree.train import interrupt, low_comm, memory
from ringtree.train.checkpointer import Checkpointer, check_resumable
from ringtree.train.config import TrainConfig, check_world, device_type
from ringtree.train.evaluation import evaluate
from ringtree.train.factories import LossFn, make_datasets, make_loss, make_model
from ringtree.train.loss import TrainingLoss
from ringtree.train.metrics import Meter, moe_metrics, powersgd_work_s
from ringtree.train.parallelize import (
    DataParallel,
    Pipeline,
    check,
    check_sequence,
    parallelize,
    virtual_stages,
)
from ringtree.train.pipelining import (
    ChunkDDPs,
    gather_stages,
    measured_bubble,
    runs,
    syncs_at_step,
    theoretical_bubble,
)
from ringtree.train.profile import StepProfiler
from ringtree.train.progress import ProgressBar
from ringtree.train.stragglers import StragglerMonitor
from ringtree.train.summary import build_summary
from ringtree.train.techniques import MixedPrecision, PrefetchLoader, ShardedStream, load_teacher
from ringtree.train.trace import Event, Recorder

Batch = Sequence[torch.Tensor]  # (inputs, targets)


@dataclass
class RankResult:
    """What one rank returns: the run's summary (the same numbers on every rank) and its spans."""

    rank: int
    summary: dict[str, Any]
    events: list[Event] = field(default_factory=list)


class Trainer:
    """Train `model` on `train_dataset` with `loss_fn(output, target)` as `config` says.

    ```python
    summary = Trainer(model, train_dataset, nn.MSELoss(), TrainConfig(pp=2, micro_batches=4)).fit()
    ```
    Under torchrun every rank runs this; without a process group, fit() trains in a world of one.
    --pp cuts an nn.Sequential (or a list of blocks, or ringtree's mlp and vit) into stages;
    --tp shards ringtree's vit. `test_dataset` adds test_loss (and accuracy, for class targets).
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        train_dataset: Dataset[Any],
        loss_fn: LossFn = F.cross_entropy,
        config: TrainConfig | None = None,
        *,
        test_dataset: Dataset[Any] | None = None,
        trace: bool = False,
        names: dict[str, str] | None = None,
    ) -> None:
        self.cfg = config or TrainConfig()
        self.net = model if isinstance(model, nn.Module) else nn.Sequential(*model)
        if isinstance(self.net, nn.ModuleList):
            self.net = nn.Sequential(*self.net)
        self.train_set, self.test_set, self.loss_fn = train_dataset, test_dataset, loss_fn
        self.trace = trace
        self.names = names or {
            "model": type(self.net).__name__,
            "dataset": type(train_dataset).__name__,
            "loss": getattr(loss_fn, "__name__", type(loss_fn).__name__),
        }
        check(self.net, self.cfg)
        check_sequence(train_dataset, self.cfg)

    @classmethod
    def from_config(cls, cfg: TrainConfig, trace: bool = False) -> Trainer:
        """The trainer `ringtree train` runs: model, data set and loss named by the config."""
        train_set, test_set = make_datasets(cfg.dataset)
        torch.manual_seed(cfg.seed)  # every rank builds the same model
        names = {"model": cfg.model, "dataset": cfg.dataset, "loss": cfg.loss}
        return cls(
            make_model(cfg.model, cfg),
            train_set,
            make_loss(cfg.loss),
            cfg,
            test_dataset=test_set,
            trace=trace,
            names=names,
        )

    def fit(self) -> dict[str, Any]:
        """Train and return the summary (the dict `ringtree train --json` writes).

        A process group that is already there (one you made, or torchrun's that you joined) is
        trained in and left as it was: still initialized, for your own collectives after fit();
        the mesh's sub-groups (TP, PP, DP, CP) made in it stay too. Without one, fit() makes it
        (torchrun's env:// world under torchrun, else a world of this one process) and destroys
        it before returning, so that the next fit() or init_process_group starts clean.
        """
        return self.run().summary

    def run(self) -> RankResult:
        """Train on the current process group, or on one it makes for the run (see fit())."""
        owned = _join_world(self.cfg)
        try:
            return _Run(self).train()
        finally:
            if owned:
                dist.destroy_process_group()


def preflight(cfg: TrainConfig) -> None:
    """Load what the config names (a user's factories too) and check the model fits the layout:
    ValueError here, in the launching process, instead of a traceback from every worker."""
    check_sequence(make_datasets(cfg.dataset)[0], cfg)
    make_loss(cfg.loss)
    model = make_model(cfg.model, cfg)
    check(model, cfg)
    if cfg.teacher is not None:
        load_teacher(cfg.teacher, make_model, report=print)  # a damaged file is named here, once
    check_resumable(cfg, model)  # no usable checkpoint, or not this model's: said here, once


def _join_world(cfg: TrainConfig) -> bool:
    """Join torchrun's world, or make a world of one process; True when this call created it."""
    if dist.is_initialized():
        return False
    backend = default_backend(device_type(cfg))
    if under_torchrun():
        init_from_env(backend, cfg.get("timeout_s"))
        return True
    store = dist.HashStore()  # type: ignore[attr-defined]  # in memory: a world of one leaves no file
    dist.init_process_group(
        backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=cfg.get("timeout_s"))
    )
    return True


def _device(cfg: TrainConfig) -> torch.device:
    if device_type(cfg) == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


@dataclass
class _PipelineRecord:
    """What this rank's pipeline runs measured, for the summary."""

    windows: list[list[float]] = field(default_factory=list)  # per run: [start, end, busy] (wall clock)
    peak_activation_bytes: int = 0
    peak_versions: int = 1
    micro_batches_per_run: int = 1


class _Run:
    """One rank's training run."""

    def __init__(self, trainer: Trainer) -> None:
        self.t, cfg = trainer, trainer.cfg
        self.cfg = cfg
        check_world(cfg, dist.get_world_size())
        self.rank = dist.get_rank()
        self.device = _device(cfg)
        # --sync: replica groups outermost (whole pipelines each), DDP inside each
        self.mesh = Mesh(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, replicas=low_comm.replicas(cfg))
        self.replicas = low_comm.groups(cfg, self.mesh)
        self.net = trainer.net
        self.parameters = sum(p.numel() for p in self.net.parameters())  # before TP keeps a shard
        dense = [(n, tuple(p.shape)) for n, p in self.net.named_parameters()]  # what checkpoints key
        self.amp = MixedPrecision(cfg.amp, self.device.type)
        teacher = None
        if cfg.teacher is not None:
            teacher = load_teacher(cfg.teacher, make_model)[0].to(self.device)
        self.loss = TrainingLoss(trainer.loss_fn, cfg, teacher, self.amp)
        self.parallel = parallelize(
            self.net, cfg, self.mesh, self.device, loss=self.loss, sample=self._sample
        )
        self.model, self.threaded, self.pipe = self.parallel.model, self.parallel.threaded, self.parallel.pipe
        self.pipe_record = _PipelineRecord()
        self.segments = self.parallel.segments
        self.recorder = Recorder(self.rank, enabled=trainer.trace)
        self.meter = Meter()
        self.activations = memory.ActivationMeter(self.net)
        self.optimizer = torch.optim.AdamW(
            self.parallel.trained, lr=cfg.get("lr"), weight_decay=cfg.weight_decay
        )
        if self.parallel.experts is not None:  # expert gradients and router biases before each step
            self.parallel.experts.register(self.optimizer)
        stage = self.net if self.pipe is None else self.pipe.stages[self.mesh.pp_rank]
        self.outer = low_comm.attach(cfg, stage, self.optimizer, self.replicas, self.parallel.sharded)
        self.a2a_s: list[tuple[float, float]] = []  # per step: all-to-all seconds, and those waited for
        self.checkpointer = Checkpointer(
            cfg, self.net, self.optimizer, self.parallel, self.mesh, self.amp, trainer.names["model"], dense
        )
        self.model_state_bytes = 0  # the most parameters + gradients + optimizer states held
        self.step = 0
        self.stragglers = (
            StragglerMonitor(device=self.device, every=cfg.straggler_every) if cfg.straggler_every else None
        )
        self.profiler = StepProfiler(cfg.profile, cfg.get("profile_steps"), self.rank, self.device)
        self.last: torch.Tensor | None = None  # the last step's mean loss (device)
        self.epoch_sums: list[Any] = [None, 0]  # this epoch's loss sum (device) and samples

    # -- setup ------------------------------------------------------------------------------

    def _sample(self) -> torch.Tensor:
        """A first batch's inputs on the device (what --pp-balance time profiles the layers on)."""
        first = next(iter(DataLoader(self.t.train_set, batch_size=self.cfg.get("batch_size"))))
        return first[0].to(self.device)  # type: ignore[no-any-return]

    def _loader(self) -> tuple[Iterable[Batch], Any]:
        """This DP rank's batches (every rank of a TP group and of a pipeline reads the same)."""
        cfg, data, mesh = self.cfg, self.t.train_set, self.mesh
        per: int = cfg.get("batch_size")
        if cfg.pp > 1 and cfg.get("schedule") in SYNCHRONOUS:
            per *= cfg.get("micro_batches")  # one run: micro_batches micro-batches of batch_size
        pin = self.device.type == "cuda" and not cfg.prefetch
        epochs: Any
        if isinstance(data, IterableDataset):
            source = data.source if isinstance(data, ShardedStream) else (lambda _epoch: data)
            epochs = ShardedStream(source, mesh.dp_rank, mesh.dp)
            loader: Iterable[Batch] = DataLoader(epochs, batch_size=per, pin_memory=pin)
        else:
            epochs = DistributedSampler(
                data, num_replicas=mesh.dp, rank=mesh.dp_rank, shuffle=True, seed=cfg.seed
            )
            loader = DataLoader(data, batch_size=per, sampler=epochs, pin_memory=pin)
        if cfg.prefetch:
            loader = PrefetchLoader(loader, self.device)
        return loader, epochs

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> RankResult:
        cfg = self.cfg
        resumed_from = self.checkpointer.resume()
        self.step = resumed_from or 0
        if resumed_from is not None and self.outer is not None:
            low_comm.load(cfg.checkpoint_dir or "", resumed_from, self.net, self.optimizer, self.outer)
        loader, epochs = self._loader()
        sized = not isinstance(self.t.train_set, IterableDataset)
        per_epoch = self._steps_per_epoch(loader) if sized else None
        total = None if per_epoch is None else cfg.get("epochs") * per_epoch
        description = f"{self.t.names['model']}, dp {self.mesh.dp} x tp {cfg.tp} x pp {cfg.pp}"
        description += f" x cp {cfg.cp}" if cfg.cp > 1 else ""
        first_epoch = 0 if per_epoch is None or not per_epoch else self.step // per_epoch
        board = interrupt.publisher() if self.rank == 0 else None  # where Ctrl-C finds the step
        training_started()  # a failure from here on is torch's report, not a one-line refusal
        if board is not None:
            board.write(self.step)  # the step resumed from
        with ProgressBar(self.rank == 0 and cfg.progress, total or 0, description) as bar:
            for epoch in range(first_epoch, cfg.get("epochs")):
                epochs.set_epoch(epoch)
                self.epoch_sums = [None, 0]
                done = epoch * per_epoch if per_epoch is not None else 0
                for unit in self._units(loader, sized):
                    n = self._unit_steps(unit)
                    if done + n <= self.step:
                        done += n
                        continue  # done before the checkpoint we resumed from
                    before = self.step
                    self.profiler.before(self.step)
                    self._train_unit(unit)
                    self.profiler.after(self.step)
                    done = self.step
                    if board is not None:
                        board.write(self.step)
                    if cfg.progress and self.step // cfg.log_every > before // cfg.log_every:
                        bar.update(self.step, self._read_last(), self.meter.rate())
                    every = cfg.checkpoint_every
                    if every and self.step // every > before // every:
                        self._save(self.step)
                if not cfg.checkpoint_every:
                    self._save(self.step)
        self.checkpointer.finish()
        self.profiler.close()  # a run that ended before --profile-steps' last step
        return RankResult(self.rank, self._summary(resumed_from), self.recorder.events)

    def _save(self, step: int) -> None:
        """A checkpoint; under --sync also each rank's replica (they differ between synchronisations)."""
        if self.outer is not None and self.cfg.checkpoint_dir is not None:
            low_comm.save(self.cfg.checkpoint_dir, step, self.net, self.optimizer, self.outer)
        self.checkpointer.save(step)

    def _steps_per_epoch(self, loader: Iterable[Batch]) -> int:
        batches = len(loader)  # type: ignore[arg-type]
        if self.pipe is not None and self.pipe.schedule not in SYNCHRONOUS:
            return batches  # pipedream steps after every micro-batch
        return math.ceil(batches / self.cfg.accumulate)

    def _units(self, loader: Iterable[Batch], sized: bool) -> Iterator[list[Any]]:
        """What one optimizer step consumes: K batches, K pipeline runs, or pipedream's whole epoch."""
        if self.pipe is not None:
            items: Iterable[Any] = runs(loader, self.pipe.schedule, self.cfg.get("micro_batches"))
            k = self.cfg.accumulate
        else:
            items, k = loader, self.cfg.accumulate
        for unit in _groups(items, k):
            if not sized:
                unit = self._agree_length(unit)
                if not unit:
                    return  # one rank ran out: every rank stops here
            yield unit
        if not sized:
            self._agree_length([])  # this rank ran out: the others learn it from this call

    def _agree_length(self, unit: list[Any]) -> list[Any]:
        """The unit cut to the shortest length on any rank (iterable data sets end unevenly)."""
        pipedream = self.pipe is not None and self.pipe.schedule not in SYNCHRONOUS
        length = len(unit[0]) if pipedream and unit else len(unit)
        flag = torch.tensor([float(length)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        n = int(flag.item())
        if pipedream:
            return [unit[0][:n]] if n else []
        return unit[:n]

    def _unit_steps(self, unit: list[Any]) -> int:
        if self.pipe is not None and self.pipe.schedule not in SYNCHRONOUS:
            return len(unit[0])
        return 1

    def _train_unit(self, unit: list[Any]) -> None:
        start, a2a, a2a_exposed = time.perf_counter(), A2A_CLOCK.seconds, A2A_CLOCK.exposed
        first = self.step
        self.loss.reset()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipe is None:
            samples, comm_s, exposed_s = self._replica_step(unit)
        else:
            samples, comm_s, exposed_s = self._pipeline_step(self.pipe, unit)
        elapsed = time.perf_counter() - start
        self.recorder.add(f"ProfilerStep#{first}", start, start + elapsed)  # as torch.profiler marks steps
        self.meter.add(elapsed, comm_s, exposed_s, samples * self.mesh.dp)
        self.a2a_s.append((A2A_CLOCK.seconds - a2a, A2A_CLOCK.exposed - a2a_exposed))
        held = memory.model_state_bytes(self.net, self.optimizer)
        self.model_state_bytes = max(self.model_state_bytes, held)
        if self.stragglers is not None:  # own work: the step less the wait for the others' gradients
            self.stragglers.step(max(0.0, elapsed - exposed_s))
        if self.loss.count:
            assert self.loss.total is not None
            self.last = self.loss.total / self.loss.count
            total, count = self.epoch_sums
            self.epoch_sums = [
                self.loss.total if total is None else total + self.loss.total,
                count + self.loss.count,
            ]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _threaded_step(self, threaded: ThreadedDataParallel, chunk: list[Batch]) -> tuple[int, float, float]:
        """One optimizer step of the seeds' single-process DataParallel (no accumulation: refused)."""
        (x, y), start = chunk[0], time.perf_counter()
        self.loss.record(threaded.forward_backward(x, y), len(y))
        self.recorder.add("forward+backward", start, time.perf_counter(), devices=len(threaded.devices))
        with self.recorder.span("optimizer", step=self.step):
            self.optimizer.step()
        self.step += 1
        return len(y), 0.0, 0.0  # no process group: nothing is communicated between processes

    def _replica_step(self, chunk: list[Batch]) -> tuple[int, float, float]:
        """One optimizer step without a pipeline: every micro-batch forward and backward, the last syncing."""
        if self.threaded is not None:
            return self._threaded_step(self.threaded, chunk)
        model = self.model
        assert model is not None
        batches = [(self._to_device(x), self._to_device(y)) for x, y in chunk]
        self.loss.prepare(x for x, _ in batches)
        total = sum(len(y) for _, y in batches)
        for i, (x, y) in enumerate(batches):
            sync: AbstractContextManager[None] = nullcontext() if i == len(batches) - 1 else model.no_sync()
            with sync:
                with self.activations.forward():
                    with self.recorder.span("forward", micro_batch=i), self.amp.autocast():
                        out = model(x)
                    loss = self.loss(out, y) * (len(y) / total)  # the mean over the step's samples
                with self.recorder.span("backward", micro_batch=i):
                    loss.backward()  # type: ignore[no-untyped-call]
        with self.recorder.span("optimizer", step=self.step):
            self._optimizer_step(pipeline_wide=True)
        self.step += 1
        return total, *self._comm_of(model)

    def _pipeline_step(self, pipe: Pipeline, unit: list[list[MicroBatch]]) -> tuple[int, float, float]:
        """K runs of the schedule, the last one synchronizing DDP and stepping (pipedream: K = 1)."""
        self.loss.weight = 1.0 / len(unit)
        comm = [0.0, 0.0]
        samples = 0
        runnable = [kept for micro in unit if (kept := self._runnable(pipe.schedule, micro))]
        for k, micro in enumerate(runnable):
            micro = [(self._to_device(x), self._to_device(y)) for x, y in micro]
            samples += sum(len(y) for _, y in micro)
            if pipe.runner.is_last:
                self.loss.prepare(x for x, _ in micro)
            schedule = build(pipe.schedule, self.cfg.pp, len(micro), virtual_stages(self.cfg))
            record = self.pipe_record
            record.micro_batches_per_run = max(record.micro_batches_per_run, len(micro))
            last = k == len(runnable) - 1
            pipe.stage.arm(schedule, self.mesh.pp_rank, sync=last)
            step: Callable[[], None] = (
                (lambda: self._pipeline_optimizer_step(pipe, comm)) if last else _nothing
            )
            self._record(pipe.runner.run(schedule, micro, step=step))
        return samples, comm[0], comm[1]

    def _runnable(self, schedule: str, micro: list[MicroBatch]) -> list[MicroBatch]:
        """The micro-batches of a run the schedule can take (a short last batch may have too few):
        interleaved, whole groups of pp; the zero-bubble ones, at least their least number or none."""
        if schedule == "interleaved":
            return micro[: len(micro) - len(micro) % self.cfg.pp]
        if schedule in ZERO_BUBBLE and len(micro) < MIN_MICRO_BATCHES_PER_STAGE[schedule] * self.cfg.pp:
            return []
        return micro

    def _pipeline_optimizer_step(self, pipe: Pipeline, comm: list[float]) -> None:
        synchronous = pipe.schedule in SYNCHRONOUS
        if pipe.ddp is not None:
            if syncs_at_step(pipe.schedule) or isinstance(pipe.ddp, ChunkDDPs):  # no backward synchronized
                pipe.ddp.sync_gradients()
            stats = pipe.ddp.last_sync
            comm[0] += stats.comm_time_s
            comm[1] += stats.exposed_s if synchronous else stats.comm_time_s
            self._bucket_spans(stats, stage=self.mesh.pp_rank)
        self._optimizer_step(pipeline_wide=synchronous)
        self.step += 1  # called once per unit by gpipe and 1f1b, per micro-batch by pipedream

    def _optimizer_step(self, pipeline_wide: bool) -> None:
        """Step every rank (rank 0 alone in the master mode); under amp all agree to skip a bad step."""

        def agree(ok: bool) -> bool:
            flag = torch.tensor([1.0 if ok else 0.0], device=self.device)
            groups = [None] if pipeline_wide else [self.mesh.tp_group, self.mesh.dp_cp_group]
            for group in groups:  # pipedream: stages step at different times, so only within a stage
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            return bool(flag.item() == 1.0)

        if isinstance(self.model, MasterDataParallel):
            self.model.last_comm = []
            if self.cfg.amp == "off" or agree(_all_finite(self.net)):
                self.model.step(self.optimizer)
            else:
                self.amp.skipped_steps += 1
            return
        if not self.amp.step(self.optimizer, agree) and self.outer is not None:
            self.outer.skip_step()  # skipped by every rank alike: counted, so the schedules stay equal

    def _comm_of(self, model: DataParallel | MasterDataParallel) -> tuple[float, float]:
        """The last step's communication time and the part of it exposed; its spans go to the trace."""
        if isinstance(model, MasterDataParallel):
            for name, s in zip(("reduce", "broadcast"), model.last_comm, strict=False):  # none if skipped
                self.recorder.add(name, s.start, s.end, "comm", bytes=s.nbytes, algorithm=self.cfg.algorithm)
            comm_s = sum(s.end - s.start for s in model.last_comm)
            return comm_s, comm_s  # nothing overlaps the master's reduce and broadcast
        stats = model.last_sync
        self._bucket_spans(stats, algorithm=self.cfg.algorithm)
        return stats.comm_time_s, stats.exposed_s

    def _bucket_spans(self, stats: Any, **detail: Any) -> None:
        """DDP's bucket all-reduces of the last sync, into the trace."""
        for s in stats.spans:
            self.recorder.add(
                f"all_reduce bucket {s.bucket}", s.start, s.end, "comm", bytes=s.nbytes, **detail
            )

    def _record(self, result: StageRun) -> None:
        """Trace spans, the run's [start, end, busy] window, the memory and version peaks."""
        work = [s for s in result.spans if s.kind != "step"]
        for s in result.spans:
            self.recorder.add(s.kind, s.start, s.end, micro_batch=s.micro_batch, stage=self.mesh.pp_rank)
        offset = time.time() - time.perf_counter()  # wall clock: comparable across the host's processes
        busy = sum(s.end - s.start for s in work)
        record = self.pipe_record
        record.windows.append([work[0].start + offset, work[-1].end + offset, busy])
        record.peak_activation_bytes = max(record.peak_activation_bytes, result.peak_activation_bytes)
        record.peak_versions = max(record.peak_versions, result.peak_versions)

    def _read_last(self) -> float:
        """The last step's loss on the host (the one read per log interval); nan on a non-last stage."""
        return float("nan") if self.last is None else float(self.last)

    # -- the end ----------------------------------------------------------------------------

    def _summary(self, resumed_from: int | None) -> dict[str, Any]:
        cfg, mesh = self.cfg, self.mesh
        if self.pipe is not None and self.pipe.ddp is not None:
            self.pipe.ddp.close()  # ZeRO: the whole trained parameters back in the model
        if isinstance(self.model, DistributedDataParallel | ShardedDataParallel):
            self.model.close()
        if self.outer is not None:  # every replica ends with the same model: one last synchronisation
            self.outer.synchronize()
            self.outer.close()
        if self.pipe is not None:
            gather_stages(self.pipe.stages, mesh.pp_rank, mesh.pp_group)
        accuracy, test_loss = evaluate(self.net, self.t.test_set, self.t.loss_fn, self.device)
        train_loss, final_loss = self._losses()
        world = dist.get_world_size()
        segments = torch.tensor([float(self.segments)], device=self.device)
        dist.all_reduce(segments, op=dist.ReduceOp.MAX)  # stages may checkpoint different numbers
        metrics: dict[str, Any] = {
            "accuracy": accuracy,
            "test_loss": test_loss,
            "train_loss": train_loss,
            "final_loss": final_loss,
            **self.meter.slowest_rank_means(self.device),
            "predicted_step_time_s": None,
            "world_size": world,
            "nodes": world // int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            "dp": mesh.dp,
            "tp": mesh.tp,
            "pp": mesh.pp,
            "cp": mesh.cp,
            "ep": cfg.ep,
            "backend": dist.get_backend(),
            "parameters": self.parameters,
            "steps": self.step,
            "resumed_from_step": resumed_from,
            "restarts": restart_count(),
            "stragglers": [] if self.stragglers is None else self.stragglers.summary(),
            "skipped_steps": self.amp.skipped_steps,
            "checkpoint_segments": int(segments[0].item()),
            "checkpoint_s": self.checkpointer.checkpoint_s(self.device),
            "distilled_from": cfg.teacher,
            **memory.fullest_rank_mb(self.model_state_bytes, self._activation_bytes(), self.device),
        }
        ddp = self.model if self.pipe is None else self.pipe.ddp
        metrics |= low_comm.metrics(cfg, self.outer, self.replicas, ddp, self.step, self.device)
        metrics["powersgd_compute_s"] = powersgd_work_s(
            [d.powersgd for d in self.parallel.powersgd if d.powersgd is not None], self.device
        )
        if self.pipe is not None:
            metrics |= self._pipeline_metrics(self.pipe_record)
        if self.parallel.experts is not None:
            metrics |= moe_metrics(self.parallel.experts, self.a2a_s, self.device)
        if self.threaded is not None:
            stats = self.threaded.stats()
            metrics |= {
                "devices": stats.get("devices"),
                "device_held_bytes": stats.get("held_bytes"),
                "device_imbalance": stats.get("imbalance"),
            }
        return build_summary(metrics, cfg, self.t.names)

    def _activation_bytes(self) -> int:
        """The most activation bytes this rank saved for backward at once (its stage's under --pp)."""
        return self.activations.peak_bytes if self.pipe is None else self.pipe_record.peak_activation_bytes

    def _losses(self) -> tuple[float | None, float | None]:
        """(last epoch's mean, last step's mean) training loss over every replica: one host read."""
        total, count = self.epoch_sums
        zero = torch.zeros((), device=self.device)
        sums = torch.stack(
            [
                zero if total is None else total.float(),
                zero + count,
                zero if self.last is None else self.last.float(),
                zero + (self.last is not None),
            ]
        )
        dist.all_reduce(sums)
        epoch_sum, epoch_n, last_sum, last_n = sums.tolist()
        return (epoch_sum / epoch_n if epoch_n else None), (last_sum / last_n if last_n else None)

    def _pipeline_metrics(self, pipe: _PipelineRecord) -> dict[str, Any]:
        cfg, group = self.cfg, self.mesh.pp_group
        mine = torch.tensor(pipe.windows or [[0.0, 1.0, 0.0]], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(cfg.pp)]
        dist.all_gather(every, mine, group=group)
        peaks = torch.tensor(
            [float(pipe.peak_activation_bytes), float(pipe.peak_versions)],
            dtype=torch.float64,
            device=self.device,
        )
        per_stage = [torch.empty_like(peaks) for _ in range(cfg.pp)]
        dist.all_gather(per_stage, peaks, group=group)
        return {
            "bubble_fraction": measured_bubble(torch.stack(every).cpu()),
            "theoretical_bubble_fraction": theoretical_bubble(
                cfg.get("schedule"), cfg.pp, pipe.micro_batches_per_run, virtual_stages(cfg)
            ),
            "peak_activation_bytes_per_stage": [int(t[0]) for t in per_stage],
            "weight_versions_per_stage": [int(t[1]) for t in per_stage],
        }


def _nothing() -> None:
    """The step callback of a pipeline run that only accumulates gradients."""


def _groups(items: Iterable[Any], k: int) -> Iterator[list[Any]]:
    """The items in groups of k (one optimizer step each; the last group may be short)."""
    group: list[Any] = []
    for item in items:
        group.append(item)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _all_finite(net: nn.Module) -> bool:
    from ringtree.train.techniques.amp import all_finite

    return all_finite(net.parameters())
