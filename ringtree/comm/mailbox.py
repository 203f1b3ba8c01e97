"""Point-to-point messages between processes of one host, through shared memory and pipes.

The pipeline's stage-to-stage transfers are small (an activation of a micro-batch) and many, so
on gloo their cost is the message, not the bytes: a send-ready notice and a wake-up of both
processes' transport threads, 1 to 1.5 ms each on a busy 2-core host. Between processes of one
host a message here is a copy into the sender's shared arena and one 32-byte write into the
receiver's pipe, which wakes it at once.

- Every process makes its pipe (a FIFO, unlinked as soon as it is open) and posts its pid, the
  pipe's descriptor and its host in the default group's store; a sender looks its receiver up
  there (with a timeout) the first time and opens the pipe through /proc/PID/fd.
- A sender keeps one arena per receiver (an anonymous memfd it maps; the receiver maps it
  through /proc/PID/fd on its first message, and a larger one replaces it when a message
  outgrows it) and one slot per key in it. No file is ever left under /dev/shm: the pipe and
  the arenas have no name and go with the processes, even killed ones.
- A key's slot is rewritten by the next send of that key, so its receiver must have received
  the previous one by then: the pipeline's schedules guarantee it
  (a stage sends micro-batch i's activation of a step only after its whole previous step, whose
  gradients came back after the next stage had received every activation of that step; and
  symmetrically for gradients).
- `recv` returns a copy, so the slot is free as soon as it returns.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ringtree.comm.errors import CollectiveError
from ringtree.comm.flight_recorder import default_store
from ringtree.comm.shm import LIVENESS_S, SHM_DIR, TRANSPORT_ENV, alive, host_key

MESSAGE = struct.Struct("<iiiiqq")  # sender, key, the arena's descriptor in the sender, (pad), offset, bytes


@dataclass
class _Peer:
    pid: int
    host: object
    pipe: int  # its pipe's descriptor in its process
    outbox: int = -1  # our end of its pipe, opened on the first send
    arena: torch.Tensor | None = None  # ours, for sending to it
    arena_fd: int = -1
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (offset, capacity)
    used: int = 0
    theirs: dict[int, torch.Tensor] = field(default_factory=dict)  # its arenas, by its descriptor


class Mailbox:
    """This process's messages with other processes of the host, by (peer rank, key)."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.prefix = f"ringtree-mailbox/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        path = SHM_DIR / f"ringtree-{os.getpid()}-{uuid.uuid4().hex[:12]}.mailbox"
        os.mkfifo(path, 0o600)
        try:
            self.inbox = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        finally:
            path.unlink()
        self.store = default_store()
        if self.store is None:
            raise RuntimeError("the shared-memory mailbox needs the default group's store")
        record = {"pipe": self.inbox, "pid": os.getpid(), "host": host_key()}
        self.store.set(f"{self.prefix}/{rank}", json.dumps(record))
        self.peers: dict[int, _Peer] = {}
        self.pending: dict[tuple[int, int], tuple[int, int, int]] = {}  # (peer, key) -> (fd, off, n)

    def peer(self, rank: int) -> _Peer:
        """Another process's record (waits for it to post one, up to the timeout)."""
        if rank not in self.peers:
            key = f"{self.prefix}/{rank}"
            try:
                self.store.wait([key], timedelta(seconds=self.timeout_s))  # type: ignore[union-attr]
            except RuntimeError as e:
                raise CollectiveError(
                    f"rank {self.rank} waited {self.timeout_s:g}s for rank {rank} to open its "
                    "shared-memory mailbox; it failed or never started"
                ) from e
            record = json.loads(self.store.get(key))  # type: ignore[union-attr]
            self.peers[rank] = _Peer(record["pid"], record["host"], record["pipe"])
        return self.peers[rank]

    def same_host(self, rank: int) -> bool:
        return host_key() is not None and self.peer(rank).host == host_key()

    def send(self, rank: int, key: int, payload: torch.Tensor) -> None:
        """Copy `payload` (bytes) into key's slot of our arena for `rank`, then ring it."""
        p = self.peer(rank)
        if p.outbox < 0:
            try:
                p.outbox = os.open(f"/proc/{p.pid}/fd/{p.pipe}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                raise CollectiveError(
                    f"rank {self.rank} cannot open rank {rank}'s shared-memory mailbox ({e}); "
                    f"set {TRANSPORT_ENV}=p2p"
                ) from e
        n = payload.numel()
        offset, capacity = p.slots.get(key, (0, -1))
        if capacity < n:
            offset = self._allocate(p, rank, n)
            p.slots[key] = (offset, n)
        assert p.arena is not None
        p.arena[offset : offset + n].copy_(payload)
        os.write(p.outbox, MESSAGE.pack(self.rank, key, p.arena_fd, 0, offset, n))

    def _allocate(self, p: _Peer, rank: int, n: int) -> int:
        """A slot of n bytes at the arena's end (64-byte aligned); a new, larger arena if full."""
        n = (n + 63) // 64 * 64
        if p.arena is None or p.used + n > p.arena.numel():
            size = max(1 << 20, 2 * (p.arena.numel() if p.arena is not None else 0), 8 * n)
            # the old arena's descriptor stays open: messages in flight may still point into it
            p.arena_fd = os.memfd_create(f"ringtree-to{rank}")
            os.posix_fallocate(p.arena_fd, 0, size)
            p.arena = torch.from_file(
                f"/proc/self/fd/{p.arena_fd}", shared=True, size=size, dtype=torch.uint8
            )
            p.slots, p.used = {}, 0
        offset, p.used = p.used, p.used + n
        return offset

    def recv(self, rank: int, keys: tuple[int, ...], what: str) -> tuple[int, torch.Tensor]:
        """The first of `keys` to arrive from `rank`, as (key, a copy of its bytes)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for key in keys:
                if (rank, key) in self.pending:
                    fd, offset, n = self.pending.pop((rank, key))
                    arena = self._their_arena(rank, fd)
                    return key, arena[offset : offset + n].clone()
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveError(
                    f"rank {self.rank} waited {self.timeout_s:g}s for {what} from rank {rank}: "
                    "it failed or is stuck"
                )
            if select.select([self.inbox], [], [], min(left, LIVENESS_S))[0]:
                self._read()
            elif not alive(self.peer(rank).pid):
                raise CollectiveError(f"rank {rank} exited while rank {self.rank} waited for {what} from it")

    def _read(self) -> None:
        data = os.read(self.inbox, MESSAGE.size * 256)
        for sender, key, fd, _, offset, n in MESSAGE.iter_unpack(data):
            self.pending[(sender, key)] = (fd, offset, n)

    def _their_arena(self, rank: int, fd: int) -> torch.Tensor:
        p = self.peer(rank)
        if fd not in p.theirs:
            path = Path(f"/proc/{p.pid}/fd/{fd}")
            p.theirs[fd] = torch.from_file(
                str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8
            )
        return p.theirs[fd]


_mailbox: Mailbox | None = None


def mailbox(timeout_s: float) -> Mailbox:
    """This process's mailbox (one per process, made on first use)."""
    global _mailbox
    if _mailbox is None:
        _mailbox = Mailbox(dist.get_rank(), timeout_s)
    return _mailbox
