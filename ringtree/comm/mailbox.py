"""Point-to-point messages between processes of one host, through shared memory and pipes.

The pipeline's stage-to-stage transfers are small (an activation of a micro-batch) and many, so
on gloo their cost is the message, not the bytes: a send-ready notice and a wake-up of both
processes' transport threads, 1 to 1.5 ms each on a busy 2-core host. Between processes of one
host a message here is a copy into the sender's shared arena and one 96-byte write into the
receiver's pipe, which wakes it at once.

- Every process makes its pipe (a FIFO, unlinked as soon as it is open) and posts its pid, the
  pipe's descriptor and its host in the default group's store; a sender looks its receiver up
  there (with a timeout) the first time and opens the pipe through /proc/PID/fd.
- A sender keeps one arena per receiver (an anonymous memfd it maps; the receiver maps it
  through /proc/PID/fd on its first message, and a larger one replaces it when a message
  outgrows it) and one slot per key in it. No file is ever left under /dev/shm: the pipe and
  the arenas have no name and go with the processes, even killed ones.
- A key's slot is rewritten by the next send of that key, so its receiver must be done with
  the previous one by then: the pipeline's schedules guarantee it (a stage sends micro-batch
  i's activation of a step only after its whole previous step, whose gradients came back after
  the next stage had run the backward of every micro-batch of that step, the last use of its
  activations; and symmetrically for gradients, used in the backward that precedes the
  gradient's own send back).
- A message carries up to META bytes of the sender's own (the pipeline's shape header) in the
  pipe's notice itself, so reading them costs no tensor operation.
- `recv` returns a copy, so the slot is free as soon as it returns; `receive` and `view` give
  a view of the slot (no copy), for a caller that is done with it before the sender's next send
  of the key.
- A receiver waiting for a message polls its pipe (yielding the core to any other runnable
  process between polls) for up to RINGTREE_MAILBOX_SPIN_US microseconds (default SPIN_US)
  before it sleeps in select(), when the host has a core for every process of it (`spin_s()`):
  a sleeping process must be woken by the sender's write, which on this virtual machine costs
  50-100 us more per message than a poll.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from ringtree.comm.errors import CollectiveError
from ringtree.comm.flight_recorder import default_store
from ringtree.comm.shm import LIVENESS_S, SHM_DIR, TRANSPORT_ENV, alive, host_key

META = 64  # bytes of the sender's own that ride in a message's notice
# sender, key, the arena's descriptor in the sender, (pad), offset, bytes, the sender's META bytes
MESSAGE = struct.Struct(f"<iiiiqq{META}s")
SPIN_ENV = "RINGTREE_MAILBOX_SPIN_US"  # how long a waiting receiver polls (microseconds; 0: never)
SPIN_US = 500  # the default: the waits of a steady 1F1B stage here (50-300 us) end while it polls


def spin_s() -> float:
    """How long a waiting receiver polls its pipe before it sleeps: SPIN_ENV's value (default
    SPIN_US, at most LIVENESS_S so that a dead sender is still noticed in time), but only with a
    core for every local process (LOCAL_WORLD_SIZE, as torchrun and ringtree.processes set it), so
    that polling takes no other process's core; 0 otherwise."""
    setting = os.environ.get(SPIN_ENV, str(SPIN_US))
    try:
        us = float(setting)
    except ValueError:
        us = -1.0
    if not 0 <= us < float("inf"):
        raise ValueError(
            f"{SPIN_ENV}={setting!r} is not a number of microseconds; set it to e.g. {SPIN_US}, "
            "or 0 to never poll"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return min(us * 1e-6, LIVENESS_S) if 0 < local <= len(os.sched_getaffinity(0)) else 0.0


class Slot(NamedTuple):
    """Where a message's payload lies: the sender's rank, its arena's descriptor there, the range."""

    rank: int
    arena: int
    offset: int
    nbytes: int


class Message(NamedTuple):
    """A message received: its key, the sender's META bytes (padded with zeros), its payload's slot."""

    key: int
    meta: bytes
    slot: Slot


@dataclass
class _Peer:
    pid: int
    host: object
    pipe: int  # its pipe's descriptor in its process
    outbox: int = -1  # our end of its pipe, opened on the first send
    arena: torch.Tensor | None = None  # ours, for sending to it
    arena_fd: int = -1
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (offset, capacity)
    base: int = 0  # our arena's address in this process
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
        # (peer, key) -> (its arena's descriptor, offset, bytes, meta)
        self.pending: dict[tuple[int, int], tuple[int, int, int, bytes]] = {}
        self.spin_s = spin_s()
        self.seen: dict[tuple[Slot, torch.dtype, tuple[int, ...]], torch.Tensor] = {}  # views of slots

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

    def send(self, rank: int, key: int, payload: torch.Tensor, meta: bytes = b"") -> None:
        """Copy `payload` (a tensor of any strides; its elements in order) into key's slot of our
        arena for `rank`, then ring it with `meta` (at most META bytes) in the notice."""
        if len(meta) > META or not payload.is_cpu:
            raise ValueError(
                f"the mailbox sends CPU tensors with at most {META} bytes of meta, got a tensor on "
                f"{payload.device} and {len(meta)} bytes"
            )
        p = self.peer(rank)
        if p.outbox < 0:
            try:
                p.outbox = os.open(f"/proc/{p.pid}/fd/{p.pipe}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                raise CollectiveError(
                    f"rank {self.rank} cannot open rank {rank}'s shared-memory mailbox ({e}); "
                    f"set {TRANSPORT_ENV}=p2p"
                ) from e
        src = payload.contiguous()
        n = src.nbytes
        offset, capacity = p.slots.get(key, (0, -1))
        if capacity < n:
            offset = self._allocate(p, rank, n)
            p.slots[key] = (offset, n)
        # a plain memmove, not a tensor copy: right after a stage's action the caches are cold and a
        # dispatched tensor operation costs 10-20 us more than its bytes (docs/pipeline.md)
        ctypes.memmove(p.base + offset, src.data_ptr(), n)
        os.write(p.outbox, MESSAGE.pack(self.rank, key, p.arena_fd, 0, offset, n, meta))

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
            p.slots, p.used, p.base = {}, 0, p.arena.data_ptr()
        offset, p.used = p.used, p.used + n
        return offset

    def recv(self, rank: int, keys: tuple[int, ...], what: str) -> tuple[int, torch.Tensor]:
        """The first of `keys` to arrive from `rank`, as (key, a copy of its bytes)."""
        key, _, slot = self.receive(rank, keys, what)
        return key, self.view(slot, torch.uint8, (slot.nbytes,)).clone()

    def receive(self, rank: int, keys: tuple[int, ...], what: str) -> Message:
        """The first of `keys` to arrive from `rank` (its payload is read with `view`)."""
        deadline = time.monotonic() + self.timeout_s
        spin_until = time.perf_counter() + self.spin_s
        while True:
            for key in keys:
                got = self.pending.pop((rank, key), None)
                if got is not None:
                    fd, offset, n, meta = got
                    return Message(key, meta, Slot(rank, fd, offset, n))
            if time.perf_counter() < spin_until:
                if not self._read():  # polled, not waited on: the pipe never blocks
                    os.sched_yield()  # a process that has work on this core goes first
                continue
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

    def _read(self) -> bool:
        """Every notice in the pipe; False if there was none (the pipe does not block)."""
        try:
            data = os.read(self.inbox, MESSAGE.size * 256)
        except BlockingIOError:
            return False
        for sender, key, fd, _, offset, n, meta in MESSAGE.iter_unpack(data):
            self.pending[(sender, key)] = (fd, offset, n, meta)
        return True

    def view(self, slot: Slot, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A message's payload as a tensor of `dtype` and `shape`, no copy: valid until its sender's
        next send of the same key. A new tensor object each time (its own requires_grad and grad)."""
        view = self.seen.get((slot, dtype, shape))
        if view is None:
            size = torch.Size(shape).numel() * dtype.itemsize
            if size != slot.nbytes:
                raise CollectiveError(
                    f"rank {self.rank} got {slot.nbytes} bytes from rank {slot.rank} but was told they "
                    f"hold a {dtype} tensor of shape {list(shape)} ({size} bytes)"
                )
            arena = self._their_arena(slot.rank, slot.arena)
            view = arena[slot.offset : slot.offset + size].view(dtype).view(shape)
            self.seen[(slot, dtype, shape)] = view
        return view.detach()

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
