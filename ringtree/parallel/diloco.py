"""DiLoCo and Streaming DiLoCo: an outer optimizer steps a global copy every H inner steps.

```python
inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
with DiLoCo(model, inner, outer, sync_every=500):
    for x, y in loader:  # the loop is unchanged: DiLoCo hooks inner.step()
        loss_fn(model(x), y).backward(); inner.step(); inner.zero_grad()
```

Each replica (one rank of `group`, or a whole DDP group whose ranks all hold the same model)
trains on its own; after inner step k H/F - T (see ringtree.schedules.outer) fragment f's
pseudo-gradient, global copy minus local parameters, is averaged over `group` (bucketed, on
ringtree's collectives, optionally quantised: ringtree.parallel.outer_codec), on a background
thread when T > 0; after inner step k H/F the outer optimizer steps the fragment's global copy
with it, and the fragment continues from global + merge_alpha (local - global). The global copy
and the outer optimizer's state live on `backup_device` (the CPU; pinned when the model is on a
GPU). The outer optimizer is handed over the model's parameters, like torch's; DiLoCo points it at
the global copy before its first step. Every sync decision comes from one step counter; a step a
loss scaler skipped must still count (`skip_step()`), so every replica keeps the same schedule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.comm import CollectiveError
from ringtree.comm.collectives import DEFAULT_TIMEOUT_S
from ringtree.parallel import outer_codec
from ringtree.parallel.outer_buckets import OuterBuckets, layers_of
from ringtree.schedules.outer import OuterSchedule, OuterSync, check, split_layers


class DiLoCo:
    """Replicas train `sync_every` steps alone; an outer optimizer then steps a global copy with their
    averaged pseudo-gradient (one fragment at a time, optionally overlapped and quantised).

    Hooks `inner_optimizer.step()` (see the module's docstring); a context manager, or call close().
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        fragments: int | Sequence[nn.Module] = 1,
        overlap_steps: int = 0,
        merge_alpha: float = 0.0,
        outer_dtype: str = "fp32",
        group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
        algorithm: str = "ring",
        fragment_layout: str = "strided",
        backup_device: str | torch.device = "cpu",
        bucket_cap_mb: float = 25.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        parts = _fragments(model, fragments, fragment_layout)
        check(sync_every, len(parts), overlap_steps)
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha (--merge-alpha) must be in [0, 1], got {merge_alpha}")
        outer_codec.check_dtype(outer_dtype)
        self.schedule = OuterSchedule(sync_every, len(parts), overlap_steps)
        self.model, self.inner, self.outer = model, inner_optimizer, outer_optimizer
        self.merge_alpha, self.outer_dtype, self.group = merge_alpha, outer_dtype, group
        self.algorithm, self.timeout_s = algorithm, timeout_s
        self.shard_group = shard_group  # this replica's ranks: each averages 1/B of every bucket
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [OuterBuckets(part, backup_device, bucket_cap_mb) for part in parts]
        self.globals = {id(p): g for b in self.buckets for p, g in zip(b.params, b.globals, strict=True)}
        _point_at_globals(outer_optimizer, params, self.globals)
        self.step = 0  # inner steps counted, skipped ones included: the one schedule every rank follows
        self.outer_syncs = 0
        self.bytes_sent = 0  # what this rank sent in outer all-reduces
        self.comm_s = 0.0  # seconds spent in outer all-reduces (on whichever thread ran them)
        self.exposed_s = 0.0  # of which the training thread waited
        self.sync_s: list[float] = []  # each fragment average's seconds on this rank, peers awaited included
        self.calls = 0  # outer collective calls (one per bucket)
        self._wire_device = _wire_device(group, params)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-diloco")
        self._inflight: tuple[OuterSync, Future[None]] | None = None
        self._agree(len(params))
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    def _agree(self, n_params: int) -> None:
        """Check every replica built the same schedule, and open the outer collectives' connections
        now (gloo connects a group's peers on first use: on a slow link, seconds of the first sync)."""
        mine = [self.schedule.sync_every, self.schedule.fragments, self.schedule.overlap_steps, n_params]
        mine.append(outer_codec.OUTER_DTYPES.index(self.outer_dtype))
        device = self._wire_device or torch.device("cpu")
        low, high = (torch.tensor(mine, dtype=torch.float64, device=device) for _ in range(2))
        comm.all_reduce(low, "min", self.algorithm, self.group, timeout_s=self.timeout_s)
        comm.all_reduce(high, "max", self.algorithm, self.group, timeout_s=self.timeout_s)
        if not torch.equal(low, high):
            names = ("sync_every", "fragments", "overlap_steps", "trainable parameters", "outer_dtype")
            odd = [n for n, a, b in zip(names, low.tolist(), high.tolist(), strict=True) if a != b]
            raise ValueError(
                f"the replicas built DiLoCo with different {', '.join(odd)}; give every rank the same"
            )
        self._average(torch.zeros(outer_codec.BLOCK, device=device))  # the wire path, once
        self.bytes_sent = 0

    # -- the hook ----------------------------------------------------------------------------

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.skip_step()

    def skip_step(self) -> None:
        """Count one inner step and run what the schedule says (the hook calls it after each step;
        call it yourself for a step a loss scaler skipped, so every replica counts the same)."""
        self.step += 1
        start, end = self.schedule.starting(self.step), self.schedule.ending(self.step)
        if start is not None:
            self._send(start)
        if end is not None:
            self._apply(end)

    def _send(self, sync: OuterSync) -> None:
        """Average the fragment's pseudo-gradient over the replicas: now (T = 0) or in the background."""
        buckets = self.buckets[sync.fragment]
        buckets.pseudo_gradient()
        if self.schedule.overlap_steps == 0:
            start = time.perf_counter()
            self._reduce(buckets)
            self.exposed_s += time.perf_counter() - start
            return
        assert self._inflight is None, "a fragment's all-reduce is already in flight"
        self._inflight = (sync, self._pool.submit(self._reduce, buckets))

    def _reduce(self, buckets: OuterBuckets) -> None:
        """One collective average per bucket (on the GPU under NCCL, on a side stream: the CUDA path)."""
        start = time.perf_counter()
        with buckets.on_wire(self._wire_device) as flats:
            for flat in flats:
                self._average(flat)
                self.calls += 1
        self.sync_s.append(time.perf_counter() - start)
        self.comm_s += self.sync_s[-1]

    def _average(self, flat: torch.Tensor) -> None:
        """Average `flat` over the replicas; with a shard group of B ranks (a replica's, all holding
        the same `flat`), rank b averages slice b only and the replica all-gathers the slices, so
        the slow link carries the model once per replica, not once per rank."""
        b = 1 if self.shard_group is None else dist.get_world_size(self.shard_group)
        if b == 1:
            self.bytes_sent += outer_codec.average(
                flat, self.outer_dtype, self.group, self.algorithm, self.timeout_s
            )
            return
        m = -(-flat.numel() // b)  # elements per slice (the last one padded)
        padded = torch.zeros(b * m, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        mine = padded[dist.get_rank(self.shard_group) * m :][:m]  # (m,) this rank's slice
        self.bytes_sent += outer_codec.average(
            mine, self.outer_dtype, self.group, self.algorithm, self.timeout_s
        )
        gathered = torch.empty_like(padded)
        gather = self.algorithm if self.algorithm in comm.algorithms("all_gather") else "ring"
        comm.all_gather(
            gathered, mine.clone(), gather, self.shard_group, timeout_s=self.timeout_s, validate=False
        )
        flat.copy_(gathered[: flat.numel()])

    def _wait(self, sync: OuterSync) -> None:
        if self._inflight is None:
            return
        start = time.perf_counter()
        inflight, future = self._inflight
        self._inflight = None
        assert inflight == sync, f"fragment sync {inflight} in flight, {sync} due"
        try:
            future.result(timeout=self.timeout_s * (len(self.buckets[sync.fragment].flats) + 1))
        except FutureTimeout:
            raise CollectiveError(
                f"DiLoCo fragment {sync.fragment}'s outer all-reduce on rank {dist.get_rank()} did not "
                f"finish in time; a replica probably stopped training"
            ) from None
        self.exposed_s += time.perf_counter() - start

    def _apply(self, sync: OuterSync) -> None:
        """Outer step of the fragment's global copy, then the fragment continues from it."""
        self._wait(sync)
        self._outer_step(self.buckets[sync.fragment], self.merge_alpha)

    def _outer_step(self, buckets: OuterBuckets, merge_alpha: float) -> None:
        for g in self.globals.values():
            g.grad = None  # the outer optimizer skips the other fragments' copies
        buckets.set_outer_gradients()
        self.outer.step()
        buckets.load_globals(merge_alpha)
        self.outer_syncs += 1

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global copy, the outer optimizer, the schedule's position (inner steps counted) and
        a fragment's averaged pseudo-gradients still to apply (waited for if in flight)."""
        pending = None
        if self._inflight is not None or self._due() is not None:
            due = self._due()
            assert due is not None
            self._wait(due)
            pending = [f.clone() for f in self.buckets[due.fragment].flats]
        return {
            "step": self.step,
            "outer_syncs": self.outer_syncs,
            "globals": [g.detach().clone() for b in self.buckets for g in b.globals],
            "outer_optimizer": self.outer.state_dict(),
            "pending": pending,
        }

    def _due(self) -> OuterSync | None:
        """The synchronisation sent but not yet applied after this step (only when T > 0), if any."""
        period = self.schedule.period
        sync = self.schedule.ending((self.step // period + 1) * period)  # the next one to apply
        return sync if sync is not None and sync.start <= self.step else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the global copy and outer optimizer as saved, the schedule where it was."""
        if self._inflight is not None:
            raise RuntimeError("DiLoCo.load_state_dict during a fragment's all-reduce")
        saved = list(state["globals"])
        mine = [g for b in self.buckets for g in b.globals]
        if len(saved) != len(mine) or any(s.shape != g.shape for s, g in zip(saved, mine, strict=True)):
            raise ValueError("DiLoCo state was saved for a different model (its global copy differs)")
        with torch.no_grad():
            for s, g in zip(saved, mine, strict=True):
                g.copy_(s)
        self.outer.load_state_dict(state["outer_optimizer"])
        self.step, self.outer_syncs = int(state["step"]), int(state["outer_syncs"])
        due = self._due()
        if (due is None) != (state.get("pending") is None):
            raise ValueError("DiLoCo state does not match this schedule (--fragments/--overlap-steps differ)")
        if due is not None:
            for f, s in zip(self.buckets[due.fragment].flats, state["pending"], strict=True):
                f.copy_(s)

    def synchronize(self) -> None:
        """Synchronise every fragment now (an outer step on what the replicas learned since its last
        synchronisation; a fragment that synchronised at this very step just takes its global
        copy), so that every replica holds the same model, the outer parameters. What the end of
        training does; a synchronisation in flight is applied first."""
        due = self._due()
        if due is not None:
            self._apply(due)
        just = self.schedule.ending(self.step)
        for f, buckets in enumerate(self.buckets):
            if just is not None and just.fragment == f:
                buckets.load_globals(0.0)
                continue
            buckets.pseudo_gradient()
            start = time.perf_counter()
            self._reduce(buckets)
            self.exposed_s += time.perf_counter() - start
            self._outer_step(buckets, 0.0)

    def close(self) -> None:
        """Remove the hook; an all-reduce still in flight is waited for."""
        self._hook.remove()
        if self._inflight is not None:
            self._inflight[1].result(timeout=self.timeout_s)
            self._inflight = None
        self._pool.shutdown(wait=True)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fragments(
    model: nn.Module, fragments: int | Sequence[nn.Module], layout: str
) -> list[list[nn.Parameter]]:
    """Each fragment's trainable parameters, in model order."""
    if not isinstance(fragments, int):
        parts = [[p for p in m.parameters() if p.requires_grad] for m in fragments]
    else:
        layers = layers_of(model)
        if fragments > len(layers):
            check(fragments, fragments, 0, len(layers))
        parts = [[p for i in idx for p in layers[i]] for idx in split_layers(len(layers), fragments, layout)]
    if any(not part for part in parts):
        raise ValueError("every DiLoCo fragment needs trainable parameters; use fewer fragments")
    return parts


def _wire_device(group: dist.ProcessGroup | None, params: list[nn.Parameter]) -> torch.device | None:
    """Where the outer collectives run: NCCL reduces only GPU tensors, gloo any (None: in place)."""
    if dist.get_backend(group) == "nccl":
        return next(
            (p.device for p in params if p.is_cuda), torch.device("cuda", torch.cuda.current_device())
        )
    return None


def _point_at_globals(
    outer: torch.optim.Optimizer, params: list[nn.Parameter], globals_: dict[int, torch.Tensor]
) -> None:
    """Make the outer optimizer step the global copy (same order) instead of the model's parameters."""
    given = [p for group in outer.param_groups for p in group["params"]]
    if {id(p) for p in given} != {id(p) for p in params} or len(given) != len(params):
        raise ValueError(
            "the outer optimizer must be built over the model's trainable parameters, exactly once each "
            "(e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))"
        )
    if outer.state:
        raise ValueError("the outer optimizer has already stepped; give DiLoCo a fresh one")
    for group in outer.param_groups:
        group["params"] = [globals_[id(p)] for p in group["params"]]
