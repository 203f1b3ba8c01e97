"""ShardedDataParallel: ZeRO-1/2/3, the all-reduce of data parallelism split into its two halves.

The parameters are grouped into DDP's fusion buckets (reverse registration order). Each bucket is
one flat buffer padded to a multiple of the group size p; DP rank r owns block r of every bucket:
its `shard` (an fp32 nn.Parameter, the only thing the optimizer steps) and the shard's gradient.
As FSDP2's are, the shards are DTensors (Shard(0) of the padded bucket over the DP group), and
they are what `parameters()` and `state_dict()` give: torch's optimizers, `clip_grad_norm_` and LR
schedulers work on `model.parameters()` unchanged. An optimizer built over the wrapped module's
whole parameters instead (which never get a gradient here) is refused at its first step.

- zero 1: gradients accumulate whole in `.grad`; the synchronizing backward moves them into the
  bucket, all-reduces it and steps with block r of it (optimizer states are 1/p).
- zero 2: every backward reduce-scatters each bucket as soon as its gradients are in and adds
  block r to the shard's gradient; the whole gradients are dropped (no_sync: summed shards).
- zero 3: and the parameters themselves live only as shards: a module's buckets are all-gathered
  just before its forward and again before its backward (a hook on its outputs), freed after.

After the optimizer stepped the shards, the next forward all-gathers them: zero 1/2 every
stepped bucket at once, zero 3 bucket by bucket as the modules run. Every collective runs on one
communication thread in the order the training thread asks for it (the same on every rank):
bucket reductions overlap the rest of backward and are waited for at its end; at zero 3 each
module's pre-hook also starts gathering the bucket the next layer needs (index - 1 in forward,
+ 1 in backward), so that gather overlaps this layer's compute. Both halves run ringtree's
reduce-scatter and all-gather schedules (`algorithm`), over shared memory inside a host.
Index names: b bucket, i parameter within a bucket, r this rank's index in the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from ringtree import comm
from ringtree.comm import CollectiveError
from ringtree.parallel.async_reduce import Span
from ringtree.parallel.buckets import MB, assign
from ringtree.parallel.ddp import SyncStats, SyncSwitch, _union
from ringtree.parallel.guard import guard_whole_parameters, unguard
from ringtree.parallel.replicas import broadcast_state, replicated
from ringtree.parallel.shard_state import ShardStateDicts
from ringtree.parallel.shards import FlatBucket, flatten, local

ZERO_STAGES = (1, 2, 3)


def zero_algorithms() -> list[str]:
    """The algorithms that have both halves: a reduce-scatter and an all-gather schedule."""
    gather = set(comm.algorithms("all_gather"))
    return [a for a in comm.algorithms("reduce_scatter") if a in gather]


class ShardedDataParallel(SyncSwitch, ShardStateDicts):
    """ZeRO stage `zero` (1, 2 or 3) over `process_group`; step `parameters()` with any optimizer.

    ```python
    model = ShardedDataParallel(net, zero=3, algorithm="ring")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # this rank's shards
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm over every rank
    ```
    `no_sync()` and `sync_next_backward()` work as in DistributedDataParallel. `full_state_dict()`
    gathers a dense copy, `load_full_state_dict()` cuts one into the shards. `close()` leaves the
    whole trained parameters in `module` (for evaluation, comparison, a dense save).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        zero: int = 3,
        algorithm: str = "ring",
        bucket_cap_mb: float = 25.0,
        timeout_s: float = comm.DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        _check_arguments(zero, algorithm, bucket_cap_mb)
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedDataParallel needs a process group: call torch.distributed.init_process_group "
                "first (torchrun, or ringtree.processes.spawn)"
            )
        self.module, self.zero, self.algorithm = module, zero, algorithm
        self.process_group, self._timeout_s = process_group, timeout_s
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        spread = "native" if algorithm == "native" else "tree"
        broadcast_state(module, process_group, spread, timeout_s, src=src)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and replicated(p)]
        first = named[0][1].device.type if named else "cpu"
        mesh = DeviceMesh.from_group(process_group or dist.group.WORLD, first)  # type: ignore[arg-type]
        self.buckets = [
            flatten(j, [named[k] for k in members], self.world_size, self.rank, separate=zero == 3, mesh=mesh)
            for j, members in enumerate(assign(named, int(bucket_cap_mb * MB)))
        ]
        guard_whole_parameters(p for _, p in named)
        self._handles: list[RemovableHandle] = []
        self._sync_enabled, self._expect_sync, self._in_backward = True, False, False
        self._next, self._validated = 0, False
        self._spans: list[Span] = []
        # Every collective runs on this one thread, in the order the training thread asks: the same
        # on every rank. Reductions are waited for at the end of backward (they overlap it);
        # all-gathers are waited for at once (their parameters are needed next).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-zero-comm")
        self._pending: list[Future[None]] = []
        self._exposed_s = 0.0
        self.last_sync = SyncStats()
        self._register_grad_hooks()
        if zero == 3:
            self._register_module_hooks()
            for bucket in self.buckets:
                bucket.free()

    # -- the public surface -------------------------------------------------------------------

    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's flat shards, one per bucket: what the optimizer steps (= `parameters()`)."""
        return [b.shard for b in self.buckets]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._expect_sync = self._sync_enabled
        if self.zero < 3:
            self._gather_stepped()
        return self.module(*inputs, **kwargs)

    def sync_gradients(self) -> None:
        """Reduce the gradients already in `.grad` (computed outside the hooks) into the shards."""
        self._expect_sync = True
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    self._take(b, i, p.grad)
                    p.grad = None
        self._finish()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the shards' gradients so the global L2 norm is at most max_norm; returns the norm.

        The squared norms of every rank's shards are summed with one all-reduce (the padding
        holds zeros, so nothing is counted twice).
        """
        grads = [local(b.shard.grad) for b in self.buckets if b.shard.grad is not None]
        device = self.buckets[0].local.device if self.buckets else torch.device("cpu")
        sq = torch.zeros((), device=device)
        for g in grads:
            sq = sq + g.float().pow(2).sum()
        comm.all_reduce(sq.view(1), "sum", "native", self.process_group, timeout_s=self._timeout_s)
        norm = sq.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale)
        return norm

    def gather_parameters(self) -> None:
        """All-gather every bucket whose shard changed (zero 3: and keep it until the next forward)."""
        self._gather_stepped()
        for b in self.buckets:
            if not b.gathered:
                self._unshard(b)

    def close(self) -> None:
        """Gather the whole parameters into `module` for good and remove the hooks."""
        self.gather_parameters()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for b in self.buckets:
            b.pinned = True
            unguard(b.params)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- gathering parameters -----------------------------------------------------------------

    def _gather_stepped(self) -> None:
        for b in self.buckets:
            if b.gathered and b.stepped():
                self._all_gather(b)

    def _unshard(self, b: FlatBucket) -> None:
        """Gather the bucket unless gathered with its shard unchanged since (or wait for its prefetch)."""
        if b.prefetch is not None:
            self._take_prefetch(b)
            return
        if b.gathered and not b.stepped():
            return
        if not b.gathered:
            b.allocate()
        self._all_gather(b)

    def _prefetch(self, j: int) -> None:
        """Start gathering bucket j (zero 3: the one the next layer needs) without waiting for it."""
        if not 0 <= j < len(self.buckets):
            return
        b = self.buckets[j]
        if b.prefetch is not None or (b.gathered and not b.stepped()):
            return
        if not b.gathered:
            b.allocate()
        b.prefetch = self._pool.submit(self._gather_job(b))

    def _take_prefetch(self, b: FlatBucket) -> None:
        assert b.prefetch is not None
        started = time.perf_counter()
        self._wait([b.prefetch], f"all-gather of bucket {b.index}")
        self._exposed_s += time.perf_counter() - started
        b.prefetch = None
        b.mark_gathered()

    def _release(self, b: FlatBucket) -> None:
        """Free the bucket's whole parameters (after its prefetch, if one is in flight)."""
        if b.prefetch is not None:
            self._take_prefetch(b)
        b.free()

    def _all_gather(self, b: FlatBucket) -> None:
        started = time.perf_counter()
        self._wait([self._pool.submit(self._gather_job(b))], f"all-gather of bucket {b.index}")
        self._exposed_s += time.perf_counter() - started
        b.mark_gathered()

    def _gather_job(self, b: FlatBucket) -> Callable[[], None]:
        shard = b.local.detach().clone()  # the input may alias a block of the output (zero 1/2)
        validate = not self._validated

        def gather() -> None:
            start = time.perf_counter()
            comm.all_gather(
                b.full,
                shard,
                self.algorithm,
                self.process_group,
                timeout_s=self._timeout_s,
                validate=validate,
            )
            nbytes = b.full.numel() * b.full.element_size()
            self._spans.append(Span(b.index, start, time.perf_counter(), nbytes))

        return gather

    def _wait(self, futures: list[Future[None]], what: str) -> None:
        """Wait for the comm thread's work (each may take its own timeout); re-raise its error here."""
        deadline = time.monotonic() + self._timeout_s * (len(futures) + 1)
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise CollectiveError(
                    f"ShardedDataParallel {what} on rank {dist.get_rank()} did not finish in time; "
                    "a peer probably stopped training"
                ) from None

    # -- zero 3: modules gather before forward and before backward -----------------------------

    def _register_module_hooks(self) -> None:
        owner = {id(p): b for b in self.buckets for p in b.params}
        for module in self.module.modules():
            mine = sorted({owner[id(p)].index for p in module.parameters(recurse=False) if id(p) in owner})
            if not mine:
                continue
            buckets = [self.buckets[j] for j in reversed(mine)]  # forward meets buckets from the last
            for b in buckets:
                b.users += 1
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(buckets)))
            self._handles.append(module.register_forward_hook(self._post_forward(buckets)))

    def _pre_forward(self, buckets: list[FlatBucket]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            for b in buckets:
                self._unshard(b)
            if not self._in_backward:  # forward meets the buckets from the last index down
                self._prefetch(min(b.index for b in buckets) - 1)

        return hook

    def _post_forward(self, buckets: list[FlatBucket]) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward:
                return  # a recomputation (activation checkpointing): backward frees these buckets
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(buckets))  # type: ignore[no-untyped-call]
            for b in buckets:
                b.forwards += 1
                if b.forwards >= b.users:
                    b.forwards = 0
                    if not b.pinned:
                        self._release(b)

        return hook

    def _pre_backward(self, buckets: list[FlatBucket]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._enter_backward()
            for b in buckets:
                self._unshard(b)
            self._prefetch(max(b.index for b in buckets) + 1)  # backward: from bucket 0 up

        return hook

    # -- backward: gradients into buckets, buckets reduced in order ------------------------------

    def _register_grad_hooks(self) -> None:
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._grad_hook(b, i))  # type: ignore[no-untyped-call]
                )

    def _grad_hook(self, b: FlatBucket, i: int) -> Any:
        def on_grad_ready(param: torch.Tensor) -> None:
            if self.zero == 1 and not self._expect_sync:
                return  # zero 1 accumulates whole gradients until the synchronizing backward
            self._enter_backward()
            assert param.grad is not None
            self._take(b, i, param.grad)
            param.grad = None  # in the bucket now (zero 2/3 never keep a whole gradient)

        return on_grad_ready

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _take(self, b: FlatBucket, i: int, grad: torch.Tensor) -> None:
        b.take(i, grad)
        self._reduce_in_order()

    def _reduce_in_order(self) -> None:
        """Reduce every complete bucket from the next unreduced one on: the same order on every rank."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete():
            self._reduce(self.buckets[self._next])
            self._next += 1

    def _reduce(self, b: FlatBucket) -> None:
        """Start the bucket's reduction on the comm thread (backward goes on meanwhile)."""
        payload = b.take_payload().div_(self.world_size)  # average as DDP does: divide, then sum
        self._pending.append(self._pool.submit(self._reduction(b, payload, not self._validated)))

    def _reduction(self, b: FlatBucket, payload: torch.Tensor, validate: bool) -> Callable[[], None]:
        def reduce() -> None:
            start = time.perf_counter()
            kw: dict[str, Any] = {"timeout_s": self._timeout_s, "validate": validate}
            if self.zero == 1:
                comm.all_reduce(payload, "sum", self.algorithm, self.process_group, **kw)
                block = payload[b.block]  # a view: zero 1 holds the whole reduced gradient, once
            else:
                block = torch.empty_like(b.local)
                comm.reduce_scatter(block, payload, "sum", self.algorithm, self.process_group, **kw)
            b.add_shard_grad(block)
            nbytes = payload.numel() * payload.element_size()
            self._spans.append(Span(b.index, start, time.perf_counter(), nbytes))
            if self.zero == 3 and not b.pinned:
                b.free()

        return reduce

    def _finish(self) -> None:
        """End of backward: buckets whose parameters got no gradient reduce zeros; stats recorded."""
        try:
            for b in self.buckets:
                b.fill_missing()
            self._reduce_in_order()
            started = time.perf_counter()
            pending, self._pending = self._pending, []
            self._wait(pending, "bucket reductions")
            self._exposed_s += time.perf_counter() - started
            if self.zero == 3:  # buckets gathered for a backward that gave them no gradient
                for b in self.buckets:
                    if not b.pinned:
                        self._release(b)
            self._validated = True
            spans = sorted(self._spans, key=lambda s: s.start)
            self.last_sync = SyncStats(_union(spans), self._exposed_s, spans)
        finally:
            self._spans, self._exposed_s = [], 0.0
            self._next = 0
            self._in_backward = False
            self._expect_sync = False


def _check_arguments(zero: int, algorithm: str, bucket_cap_mb: float) -> None:
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be 1, 2 or 3 (0 is DistributedDataParallel), got {zero}")
    if algorithm not in zero_algorithms():
        raise ValueError(
            f"algorithm {algorithm!r} has no reduce-scatter/all-gather schedule for ZeRO; "
            f"choose one of {', '.join(zero_algorithms())}"
        )
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; torch's default is 25")


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, tuple | list):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
