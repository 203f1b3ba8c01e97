"""The seeds' DP: one master rank gathers the gradients, updates, and sends the parameters back.

This is the design DDP replaced: every step, every rank's whole gradient travels to rank 0
(reduce), rank 0 alone runs the optimizer, and the new parameters travel back (broadcast), so
rank 0's link carries p times the model while the others idle. Kept to measure that bottleneck.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.parallel.async_reduce import Span
from ringtree.parallel.replicas import broadcast_state

MASTER = 0


class MasterDataParallel(nn.Module):
    """Data parallelism through a master rank: call `step(optimizer)` instead of optimizer.step().

    `algorithm` names the reduce and broadcast schedules: "ps" (default: every rank talks to the
    master directly, the textbook bottleneck), "tree", "ring" or "native".
    """

    def __init__(
        self,
        module: nn.Module,
        algorithm: str = "ps",
        process_group: dist.ProcessGroup | None = None,
        timeout_s: float = comm.DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        valid = [a for a in comm.algorithms("reduce") if a in comm.algorithms("broadcast")]
        if algorithm not in valid:
            raise ValueError(
                f"the master-rank dp mode reduces and broadcasts, so its algorithm must be one of "
                f"{', '.join(valid)}; got {algorithm!r}"
            )
        self.module, self.algorithm, self.process_group = module, algorithm, process_group
        self.timeout_s = timeout_s
        self.world_size = dist.get_world_size(process_group)
        self._validated = False
        self.last_comm: list[Span] = []  # the last step's reduce (0) and broadcast (1)
        broadcast_state(module, process_group, algorithm, timeout_s)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients only ever accumulate locally until step(): nothing to switch off."""
        yield

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Reduce the gradients onto the master, step there, broadcast the parameters back."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        validate, self._validated = not self._validated, True
        kw: dict[str, Any] = {"timeout_s": self.timeout_s, "validate": validate}
        nbytes = flat.numel() * flat.element_size()
        start = time.perf_counter()
        comm.reduce(flat, MASTER, "sum", self.algorithm, self.process_group, **kw)
        self.last_comm = [Span(0, start, time.perf_counter(), nbytes)]
        is_master = dist.get_rank() == MASTER
        if is_master:
            flat.div_(self.world_size)
            _unflatten_into(flat, params, grads=True)
            optimizer.step()
        with torch.no_grad():
            weights = torch.cat([p.detach().reshape(-1) for p in params])
            start = time.perf_counter()
            comm.broadcast(weights, MASTER, self.algorithm, self.process_group, **kw)
            self.last_comm.append(Span(1, start, time.perf_counter(), nbytes))
            if not is_master:
                _unflatten_into(weights, params, grads=False)


def _unflatten_into(flat: torch.Tensor, params: list[nn.Parameter], *, grads: bool) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            piece = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if not grads:
                p.copy_(piece)
            elif p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
