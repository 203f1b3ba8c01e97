"""Local SGD: every replica steps on its own; the parameters are averaged every H optimizer steps.

```python
with LocalSGD(model, optimizer, sync_every=16):
    for x, y in loader:  # unchanged: LocalSGD hooks optimizer.step()
        loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
```

The schedule is torch's PeriodicModelAverager's (torch.distributed.algorithms.model_averaging):
the k-th step (k = 0, 1, ...) is followed by an average when k >= warmup_steps and
(k - warmup_steps) % H == 0. Under ringtree's DDP inside each replica group and `group` across
them, this is torch's hierarchical post-local SGD: the fast links every step, the slow ones every H.
Optimizer states stay per replica. The average is ringtree's all-reduce on flat buckets.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.comm.collectives import DEFAULT_TIMEOUT_S
from ringtree.parallel.buckets import MB


class LocalSGD:
    """Replicas step alone and average their parameters every `sync_every` steps (torch's averager's
    schedule). Hooks `optimizer.step()`; a context manager, or call close()."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        group: dist.ProcessGroup | None = None,
        *,
        warmup_steps: int = 0,
        algorithm: str = "ring",
        bucket_cap_mb: float = 25.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (--inner-steps) must be at least 1, got {sync_every}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be at least 0, got {warmup_steps}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sync_every, self.warmup_steps, self.group = sync_every, warmup_steps, group
        self.algorithm, self.timeout_s = algorithm, timeout_s
        self.buckets = _buckets(self.params, bucket_cap_mb)
        self.step = 0  # steps counted, skipped ones included: torch's averager's counter
        self._averaged_at = -1  # the step count after which the parameters were last averaged
        self.outer_syncs = 0
        self.bytes_sent = 0
        self.comm_s = 0.0
        self.sync_s: list[float] = []  # each average's seconds on this rank, waiting for peers included
        self.calls = 0
        self._warm_up()
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _warm_up(self) -> None:
        """Open the group's connections now (gloo connects peers on first use), checking on the way
        that every replica has the same schedule."""
        mine = torch.tensor([float(self.sync_every), float(self.warmup_steps), float(len(self.params))])
        low, high = mine.clone(), mine.clone()
        comm.all_reduce(low, "min", self.algorithm, self.group, timeout_s=self.timeout_s)
        comm.all_reduce(high, "max", self.algorithm, self.group, timeout_s=self.timeout_s)
        if not torch.equal(low, high):
            raise ValueError(
                "the replicas built LocalSGD with different sync_every, warmup_steps or parameters"
            )

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.skip_step()

    def skip_step(self) -> None:
        """Count one step, averaging when the schedule says (the hook calls it after each step;
        call it yourself for a step a loss scaler skipped, so every replica counts the same)."""
        k = self.step
        if k >= self.warmup_steps and (k - self.warmup_steps) % self.sync_every == 0:
            self.average()
        self.step += 1

    @torch.no_grad()
    def average(self) -> None:
        """Average the parameters over `group` now: one all-reduce per bucket."""
        start = time.perf_counter()
        r = dist.get_world_size(self.group)
        for bucket in self.buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            comm.all_reduce(flat, "avg", self.algorithm, self.group, timeout_s=self.timeout_s, validate=False)
            offset = 0
            for p in bucket:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.bytes_sent += 2 * (r - 1) * flat.numel() * flat.element_size() // r
            self.calls += 1
        self.sync_s.append(time.perf_counter() - start)
        self.comm_s += self.sync_s[-1]
        self.outer_syncs += 1
        self._averaged_at = self.step

    def synchronize(self) -> None:
        """Average now unless the last step did, so that every replica holds the same model (what
        the end of training does)."""
        if self._averaged_at != self.step:
            self.average()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "outer_syncs": self.outer_syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.outer_syncs = int(state["step"]), int(state["outer_syncs"])

    def close(self) -> None:
        self._hook.remove()

    def __enter__(self) -> LocalSGD:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buckets(params: list[nn.Parameter], cap_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most cap_mb each (one parameter may exceed it)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if not same or size + nbytes > cap_mb * MB:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
