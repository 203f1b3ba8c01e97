"""DistributedDataParallel: fusion buckets reduced during backward by any ringtree algorithm.

The flow of the seeds: every rank holds the whole model, runs forward and backward on its own
share of the batch, and the gradients are averaged across ranks before every rank steps.
Gradients are divided by the world size into flat buckets (reverse registration order, a small
first bucket) as autograd produces them, and each parameter's `.grad` then becomes its slice of
the bucket (torch DDP's gradient_as_bucket_view, always on): the reduced values land in `.grad`
with no copy back, and a gradient that autograd accumulates into an existing `.grad` (no_sync,
zero_grad(set_to_none=False)) is already in its bucket. A bucket whose gradients are all in is
launched at once, so its all-reduce overlaps the rest of backward. backward() returns only
after every bucket is reduced; the last bucket (ready only when backward's compute is done), and
any the comm thread has not started by then, run on backward's own thread. When ringtree's
schedules run over shared memory (every rank of the group on this host, CPU), the buckets live
there and are reduced in place, ranks yield their core at every gradient so that they reach
each bucket together, and where the host's ranks outnumber its cores each is pinned to one of
them while the wrapper lives (placement.py).
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.comm import shm
from ringtree.comm.powersgd import PowerSGD
from ringtree.parallel import placement
from ringtree.parallel.async_reduce import Launcher, Span, make_launcher
from ringtree.parallel.buckets import MB, Allocator, Bucket, build
from ringtree.parallel.replicas import broadcast_state, replicated

COMPRESSION: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

# torch DDP arguments that ringtree accepts so scripts run unchanged, and their no-op defaults.
_TORCH_ONLY_DEFAULTS: dict[str, Any] = {
    "output_device": None,
    "dim": 0,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
}


@dataclass
class SyncStats:
    """What the last gradient synchronization cost: comm wall time and the part backward waited for."""

    comm_time_s: float = 0.0  # wall time during which at least one bucket was in flight
    exposed_s: float = 0.0  # time backward spent blocked on communication after its compute
    spans: list[Span] = field(default_factory=list)


class SyncSwitch:
    """When a data-parallel wrapper's backward synchronizes: the one switch DDP and ZeRO share.

    A forward outside no_sync() (or sync_next_backward()) makes the next backward synchronize;
    inside no_sync() backward only accumulates (ZeRO 2/3: into summed gradient shards).
    """

    _sync_enabled: bool = True  # False inside no_sync()
    _expect_sync: bool = False  # set by a forward outside no_sync, cleared when the sync ends

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally (gradient accumulation)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_next_backward(self) -> None:
        """Make the backward that starts now synchronize, whatever no_sync() said at its forward.

        For callers that run several forwards before their backwards (a pipeline stage's
        micro-batches): every forward under no_sync(), then this just before the last backward.
        """
        self._expect_sync = True


class DistributedDataParallel(SyncSwitch, nn.Module):
    """A drop-in for torch.nn.parallel.DistributedDataParallel with a pluggable all-reduce algorithm.

    `algorithm`: any of ringtree.comm.algorithms() ("native" is torch's own). `compression`:
    None, "fp16" or "bf16": buckets travel in that dtype and return into the fp32 gradients;
    a `PowerSGD(...)` (or "powersgd": `PowerSGD()`): buckets travel as low-rank factors, their
    P and Q summed by `algorithm` (ringtree.comm.powersgd), the state in `self.powersgd`.
    `overlap=False` launches every bucket after backward's compute (to measure what overlap buys).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int] | None = None,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        *,
        algorithm: str = "ring",
        compression: str | PowerSGD | None = None,
        overlap: bool = True,
        timeout_s: float = comm.DEFAULT_TIMEOUT_S,
        **torch_only: Any,
    ) -> None:
        super().__init__()
        _check_arguments(bucket_cap_mb, compression, torch_only)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call "
                "torch.distributed.init_process_group first (torchrun, or ringtree.processes.spawn)"
            )
        self.module = module
        self.device_ids = device_ids
        self.powersgd = _powersgd(compression)
        self.compression = "powersgd" if self.powersgd is not None else compression
        self.algorithm, self.overlap = algorithm, overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._launcher: Launcher = make_launcher(
            algorithm, process_group, timeout_s, None if self.powersgd is None else self._powersgd_reducer()
        )
        self._timeout_s = timeout_s
        # the group's first rank is the source (a subgroup, e.g. a mesh's dp_group, may not hold rank 0)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        broadcast_state(module, process_group, _broadcast_algorithm(algorithm), timeout_s, src=self._src)
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and replicated(p)]
        self.buckets: list[Bucket] = build(self._named, int(bucket_cap_mb * MB), self._shared_allocator())
        # Ranks on one host share its cores: yield the core at every gradient and every forward,
        # so that ranks progress together and a bucket's ring starts when the last rank is ready
        # (4 ranks on 2 cores: exposed communication 11.5 -> 7 ms of a 35 ms step, step unchanged;
        # docs/results/benchmarks.md). sched_yield returns at once when nothing else waits for the core.
        self._yield = any(shm.is_shared(b.buffer) for b in self.buckets)
        # ... and spread them evenly over its cores where they outnumber them (placement.py)
        self._unpin = placement.spread() if self._yield else None
        self._register_hooks()
        self._sync_enabled = True  # False inside no_sync()
        self._expect_sync = False  # set by a forward outside no_sync, cleared when the sync ends
        self._in_backward = False
        self._next_bucket = 0
        self._payloads: dict[int, torch.Tensor] = {}
        self._validated = False
        self._exposed_s = 0.0
        self.last_sync = SyncStats()

    def _shared_allocator(self) -> Allocator | None:
        """Buckets in shared memory where ringtree's schedules run over it (every rank of the
        group on this host, CPU, gloo): peers read them in place, nothing is copied in or out of
        the transport. Compressed buckets travel as copies, so they stay in private memory."""
        if self.algorithm == "native" or self.compression is not None or self.world_size == 1:
            return None
        if any(p.device.type != "cpu" for _, p in self._named):
            return None
        pg = self.process_group or dist.distributed_c10d._get_default_group()
        timeout = timedelta(seconds=self._timeout_s)
        return lambda numel, dtype: shm.shared_buffer(numel, dtype, pg, timeout)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; a forward outside no_sync() makes the next backward synchronize."""
        if torch.is_grad_enabled():
            if self._yield:
                os.sched_yield()
            self._expect_sync = self._sync_enabled
            if self.broadcast_buffers and self.world_size > 1:
                broadcast_state(
                    self.module,
                    self.process_group,
                    "native",
                    self._timeout_s,
                    params=False,
                    validate=False,
                    src=self._src,
                )
        return self.module(*inputs, **kwargs)

    def sync_gradients(self) -> None:
        """All-reduce, in buckets, the gradients already in `.grad` (outside any backward).

        For gradients autograd did not deliver through the parameters' hooks (PipeDream's weight
        stashing computes them on copies and hands them over afterwards).
        """
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    self._fill(bucket, i, p)
                    self._mark_ready(bucket, i)
        self._finish()

    def close(self) -> None:
        """Stop the communication thread and undo the ranks' placement (also done when the
        object is collected)."""
        self._launcher.close()
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()

    def __del__(self) -> None:
        launcher, unpin = self.__dict__.get("_launcher"), self.__dict__.get("_unpin")
        if launcher is not None:
            launcher.close()
        if unpin is not None:
            unpin()

    # -- backward: hooks fill buckets, the end-of-backward callback waits and writes back --------

    def _register_hooks(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._hook(bucket.index, i)
                )

    def _hook(self, j: int, i: int) -> Any:
        # The hook lives on the parameter, inside torch's C++ where the garbage collector cannot
        # follow: a strong reference back to this wrapper or its buckets (which hold the
        # parameter) would keep them, and the buckets' shared memory, for as long as the process runs.
        owner = weakref.ref(self)

        def on_grad_ready(param: torch.Tensor) -> None:
            self = owner()
            if self is None or not self._expect_sync:
                return
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            bucket = self.buckets[j]
            assert param.grad is not None and i not in bucket.ready
            self._fill(bucket, i, param)
            self._mark_ready(bucket, i)
            if self._yield:
                os.sched_yield()

        return on_grad_ready

    def _fill(self, bucket: Bucket, i: int, param: torch.Tensor) -> None:
        """Put param's gradient, divided by the world size (torch's DDP divides, then sums), into
        its slice of the bucket in one pass, and make that slice its `.grad`. PowerSGD takes the
        gradient whole, as torch's hook does (its error feedback keeps the undivided gradient)."""
        view, grad = bucket.view(i), param.grad
        assert grad is not None
        divisor = 1 if self.powersgd is not None else self.world_size
        if bucket.holds(i, grad):
            if divisor != 1:
                view.div_(divisor)
        elif divisor != 1:
            torch.div(grad, divisor, out=view)
            param.grad = view
        else:
            view.copy_(grad)
            param.grad = view

    def _powersgd_reducer(self) -> Any:
        """What the launcher runs per bucket with PowerSGD: its sums on ringtree's `algorithm`.
        (A weak reference: the launcher's thread must not keep this wrapper alive.)"""
        owner = weakref.ref(self)

        def reduce(j: int, tensor: torch.Tensor, validate: bool) -> None:
            self = owner()
            assert self is not None and self.powersgd is not None
            bucket = self.buckets[j]

            def all_reduce(t: torch.Tensor) -> None:
                if t.numel():  # every rank's bucket splits alike: all skip the same empty sums
                    comm.all_reduce(
                        t,
                        "sum",
                        self.algorithm,
                        self.process_group,
                        timeout_s=self._timeout_s,
                        validate=validate,
                    )

            self.powersgd.reduce(j, bucket.buffer, bucket.views, self.world_size, all_reduce)

        return reduce

    def _mark_ready(self, bucket: Bucket, i: int) -> None:
        bucket.ready.add(i)
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch_in_order()

    def _launch_in_order(self, defer: bool = False) -> None:
        """Launch every ready bucket from the next unlaunched one on: the same order on every rank.

        defer=True at the end of backward: the caller waits next, so the launcher may run them
        on this thread rather than hand them to its comm thread and sleep."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            payload = bucket.buffer
            if self.compression in COMPRESSION:
                payload = payload.to(COMPRESSION[self.compression])
            self._payloads[bucket.index] = payload
            # the last bucket completes backward's gradients: the end-of-backward callback, on
            # this thread, runs it next, so handing it to the comm thread would only add a wake-up
            last = self._next_bucket == len(self.buckets) - 1
            started = time.perf_counter()
            self._launcher.launch(bucket.index, payload, validate=not self._validated, defer=defer or last)
            self._exposed_s += time.perf_counter() - started  # launching is exposed too
            self._next_bucket += 1

    def _finish(self) -> None:
        """End of backward: account for missing gradients, wait for every bucket, write back."""
        try:
            missing = self._missing()
            if missing and not self.find_unused_parameters:
                self._launcher.wait_all()  # drain what was launched: every rank launched the same
                raise ValueError(_unused_message(missing))
            local_used = self._local_used()
            for bucket, i in missing:
                p = bucket.params[i]
                if bucket.holds(i, p.grad):  # keep this rank's gradient out of the zeroed slice
                    p.grad = bucket.view(i).clone()
                bucket.view(i).zero_()
                self._mark_ready(bucket, i)
            self._launch_in_order(defer=True)
            started = time.perf_counter()
            spans = self._launcher.wait_all()
            self._exposed_s += time.perf_counter() - started
            # every rank runs this all-reduce (same setting), whether or not it missed gradients
            used = self._globally_used(local_used) if self.find_unused_parameters else None
            if missing or self.compression in COMPRESSION:
                self._write_back(used)
            if self.powersgd is not None:
                self.powersgd.step_done()
            self._validated = True
            self.last_sync = SyncStats(_union(spans), self._exposed_s, spans)
        finally:
            self._reset()

    def _missing(self) -> list[tuple[Bucket, int]]:
        return [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.ready]

    def _local_used(self) -> torch.Tensor:
        """Per trainable parameter (bucket order), 1 if this rank produced its gradient, else 0."""
        flags = [float(i in b.ready) for b in self.buckets for i in range(len(b.params))]
        return torch.tensor(flags, device=self.buckets[0].buffer.device)

    def _globally_used(self, local_used: torch.Tensor) -> torch.Tensor:
        """Whether any rank produced each parameter's gradient (one small all-reduce)."""
        comm.all_reduce(local_used, "sum", "native", self.process_group, timeout_s=self._timeout_s)
        return local_used > 0

    def _write_back(self, used: torch.Tensor | None) -> None:
        """Compressed payloads back into the buckets; the gradients of parameters some rank
        skipped become their bucket views too (unless no rank used them)."""
        k = 0
        with torch.no_grad():
            for bucket in self.buckets:
                if self.compression in COMPRESSION:
                    bucket.buffer.copy_(self._payloads[bucket.index])
                for i, p in enumerate(bucket.params):
                    if used is not None and not used[k]:
                        pass  # no rank used it: leave its gradient as it is, like torch's DDP
                    elif not bucket.holds(i, p.grad):
                        p.grad = bucket.view(i)
                    k += 1

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._payloads.clear()
        self._next_bucket = 0
        self._in_backward = False
        self._expect_sync = False
        self._exposed_s = 0.0


def _check_arguments(
    bucket_cap_mb: float, compression: str | PowerSGD | None, torch_only: dict[str, Any]
) -> None:
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; torch's default is 25")
    known = (
        compression is None or isinstance(compression, PowerSGD) or compression in (*COMPRESSION, "powersgd")
    )
    if not known:
        raise ValueError(
            f"unknown compression {compression!r}; choose None, 'fp16', 'bf16', 'powersgd' or a PowerSGD(...)"
        )
    unknown = sorted(set(torch_only) - set(_TORCH_ONLY_DEFAULTS))
    if unknown:
        raise TypeError(f"DistributedDataParallel got unexpected argument(s) {', '.join(unknown)}")
    for name, value in torch_only.items():
        if name == "gradient_as_bucket_view":
            continue  # ringtree's gradients are always bucket views: either answer runs the same
        if value != _TORCH_ONLY_DEFAULTS[name]:
            warnings.warn(
                f"ringtree's DistributedDataParallel ignores {name}={value!r} (torch-only option)",
                stacklevel=3,
            )


def _powersgd(compression: str | PowerSGD | None) -> PowerSGD | None:
    """The PowerSGD state a `compression` argument asks for ("powersgd": torch's defaults)."""
    if isinstance(compression, PowerSGD):
        compression.bind()
        return compression
    return PowerSGD() if compression == "powersgd" else None


def _broadcast_algorithm(algorithm: str) -> str:
    return "native" if algorithm == "native" else "tree"


def _unused_message(missing: list[tuple[Bucket, int]]) -> str:
    names = ", ".join(b.names[i] for b, i in missing[:10]) + (" ..." if len(missing) > 10 else "")
    return (
        f"{len(missing)} parameter(s) received no gradient in this backward pass: {names}. "
        "Make every parameter take part in the loss, set requires_grad=False on the unused ones, "
        "or pass find_unused_parameters=True to DistributedDataParallel"
    )


def _union(spans: list[Span]) -> float:
    """Total length of the union of the spans' intervals (overlapping buckets counted once)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total
