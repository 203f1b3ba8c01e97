"""The shared-memory mailbox: messages by key, in any order, growing arenas, nothing left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ringtree.comm import CollectiveError
from ringtree.comm.mailbox import mailbox
from ringtree.launch import spawn


def _files() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("ringtree-*"))


def exchange(rank: int) -> dict[str, object]:
    box = mailbox(timeout_s=20)
    out: dict[str, object] = {}
    if rank == 0:
        box.send(1, 0, torch.arange(10, dtype=torch.uint8))
        box.send(1, 1, torch.full((3 << 20,), 7, dtype=torch.uint8))  # outgrows the 1 MiB arena
        box.send(1, 2, torch.arange(100, dtype=torch.uint8))
        key, back = box.recv(1, (9,), "the answer")
        out["answer"] = (key, back.tolist())
    else:
        k1, big = box.recv(0, (1,), "the big one")  # out of order: key 1 before key 0
        k0, small = box.recv(0, (0,), "the small one")
        k2, later = box.recv(0, (5, 2), "either")
        out["got"] = (k1, int(big.sum()), big.numel(), k0, small.tolist(), k2, later[:3].tolist())
        box.send(0, 9, torch.tensor([1, 2, 3], dtype=torch.uint8))
    dist.barrier()
    out["left"] = _files()
    return out


def test_messages_arrive_by_key_and_nothing_is_left_behind() -> None:
    sender, receiver = spawn(exchange, 2, timeout_s=90)
    assert receiver["got"] == (1, 7 * (3 << 20), 3 << 20, 0, list(range(10)), 2, [0, 1, 2])
    assert sender["answer"] == (9, [1, 2, 3])
    assert sender["left"] == [] and receiver["left"] == []


def dies(rank: int) -> str:
    box = mailbox(timeout_s=30)
    box.send(1 - rank, 0, torch.zeros(4, dtype=torch.uint8))
    box.recv(1 - rank, (0,), "the first")
    dist.barrier()
    if rank == 0:
        os._exit(0)
    start = time.monotonic()
    try:
        box.recv(0, (1,), "a message that never comes")
    except CollectiveError as e:
        return f"{time.monotonic() - start:.1f} {e}"
    return "no error"


def test_a_sender_that_dies_is_named_at_once() -> None:
    message = spawn(dies, 2, timeout_s=60, allow_missing=True)[1]
    seconds, _, text = message.partition(" ")
    assert "rank 0 exited while rank 1 waited for a message that never comes" in text
    assert float(seconds) < 10


def silent(rank: int) -> str:
    box = mailbox(timeout_s=1.5)
    box.send(1 - rank, 0, torch.zeros(4, dtype=torch.uint8))
    box.recv(1 - rank, (0,), "the first")
    if rank == 0:
        time.sleep(4)  # alive, but never sends key 7
        return ""
    try:
        box.recv(0, (7,), "a message that never comes")
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_a_live_sender_that_never_sends_times_out() -> None:
    message = spawn(silent, 2, timeout_s=60)[1]
    assert "rank 1 waited 1.5s for a message that never comes from rank 0" in message
