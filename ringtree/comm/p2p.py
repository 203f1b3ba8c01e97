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

    def __init__(self, works: list[dist.Work], buffers: list[torch.Tensor], what: str, ring: Ring) -> None:
        self._works, self.what = works, what
        self._sent, self.received = buffers  # the send buffer is kept alive until the send is done
        self.next, self.prev = ring.next, ring.prev

    def wait(self, timeout_s: float = 60.0) -> torch.Tensor:
        for work in self._works:
            try:
                work.wait(timedelta(seconds=timeout_s))
            except RuntimeError as e:
                raise CollectiveError(
                    f"ring shift of {self.what} (to rank {self.next}, from rank {self.prev}) did not "
                    f"complete within {timeout_s:g} s: {e}",
                    peer=self.prev,
                ) from e
        self._sent = self.received  # the send buffer may be reused from here on
        return self.received


class Ring:
    """The ranks of `group` in a ring: rank r sends to r+1 and receives from r-1 (mod the size)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        """The world rank of a rank of the group (point-to-point ops address world ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

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
        return Shift(dist.batch_isend_irecv(ops), [sent, received], what, self)
