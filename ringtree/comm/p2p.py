"""Point-to-point around a ring: every rank sends a tensor to the next rank and receives the previous
rank's, asynchronously, so that the caller computes while the bytes travel (ring attention).

One shift is one `torch.distributed.batch_isend_irecv` of a send and a receive (gloo on CPU, NCCL
on GPU, where batching the pair is what keeps two ranks that send to each other from deadlocking).
Each kind of message has its own tag, so a ring of K/V and a ring of their gradients in flight at
the same time never take each other's messages. `counts` records the shifts each rank started, by
what they carried: tests and `ringtree show ring-attention` compare it with the schedule.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree.comm.errors import CollectiveError

counts: Counter[str] = Counter()  # shifts started by this process, by what they carried
TAGS = {"kv": 11, "dkv": 12}  # one tag per kind of message in flight at once


class Shift:
    """One shift in flight: `wait()` returns the previous rank's tensor."""

    def __init__(self, works: list[dist.Work], received: torch.Tensor, sent: torch.Tensor, what: str) -> None:
        self._works, self.received, self._sent, self.what = works, received, sent, what

    def wait(self, timeout_s: float = 60.0) -> torch.Tensor:
        for work in self._works:
            try:
                work.wait(timedelta(seconds=timeout_s))
            except RuntimeError as e:
                raise CollectiveError(f"ring shift of {self.what} did not complete: {e}") from e
        self._sent = self.received  # the send buffer may be reused from here on
        return self.received


class Ring:
    """The ranks of `group` in a ring: rank r sends to r+1 and receives from r-1 (mod the size)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (
            dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        )
        prev = (self.rank - 1) % self.size
        self.prev = dist.get_global_rank(group, prev) if group else prev

    def shift(self, tensor: torch.Tensor, what: str = "kv") -> Shift:
        """Start sending `tensor` to the next rank and receiving the previous rank's into a new buffer."""
        sent = tensor.contiguous()
        received = torch.empty_like(sent)
        tag = TAGS.get(what, 10)
        ops = [
            dist.P2POp(dist.isend, sent, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        counts[what] += 1
        return Shift(dist.batch_isend_irecv(ops), received, sent, what)
