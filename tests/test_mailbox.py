"""The shared-memory mailbox: messages by key, in any order, growing arenas, nothing left behind;
meta bytes in the notice, payloads read in place; a bounded poll before sleeping."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringtree.comm import CollectiveError
from ringtree.comm.mailbox import META, SPIN_ENV, SPIN_US, mailbox, spin_s
from ringtree.comm.shm import LIVENESS_S
from ringtree.processes import spawn


def _files(pids: list[int] | None = None) -> list[str]:
    """ringtree's shared-memory files (named ringtree-PID-...), only those of `pids` if given: other
    tests' killed ranks may have left theirs."""
    names = sorted(p.name for p in Path("/dev/shm").glob("ringtree-*"))
    return [n for n in names if pids is None or int(n.split("-")[1]) in pids]


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
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    out["left"] = _files(pids)
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


def in_place(rank: int) -> dict[str, object]:
    """Rank 0 sends a transposed tensor that requires grad, with meta; rank 1 reads it in place."""
    box = mailbox(timeout_s=20)
    w = torch.arange(12, dtype=torch.float32).view(3, 4).requires_grad_()
    if rank == 0:
        box.send(1, 4, (w * 2).t(), b"shape 4x3")  # not contiguous, part of an autograd graph
        box.recv(1, (5,), "the reply")  # rank 1 read key 4 before key 4 is written again
        box.send(1, 4, w.detach().t() * 3, b"again")
        out: dict[str, object] = {}
    else:
        key, meta, slot = box.receive(0, (4,), "the tensor")
        a, b = box.view(slot, torch.float32, (4, 3)), box.view(slot, torch.float32, (4, 3))
        first = a.clone()
        box.send(0, 5, torch.zeros(1))
        _, meta2, slot2 = box.receive(0, (4,), "the tensor again")
        out = {
            "key": key,
            "meta": (meta, meta2[:5]),
            "first": first.tolist(),
            "in_place": a.tolist(),  # the view of the slot shows the second message: no copy was made
            "objects": (a is not b, a.data_ptr() == b.data_ptr(), a.requires_grad),
        }
        try:
            box.view(slot2, torch.float32, (5, 3))
        except CollectiveError as e:
            out["wrong_shape"] = str(e)
    dist.barrier()
    return out


def test_meta_rides_in_the_notice_and_payloads_are_read_in_place() -> None:
    receiver = spawn(in_place, 2, timeout_s=90)[1]
    w = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert receiver["key"] == 4
    assert receiver["meta"] == (b"shape 4x3" + bytes(META - 9), b"again")
    assert receiver["first"] == (w * 2).t().tolist()
    assert receiver["in_place"] == (w * 3).t().tolist()
    assert receiver["objects"] == (True, True, False)  # a new tensor per view, over the same bytes
    assert "48 bytes from rank 0" in str(receiver["wrong_shape"]) and "[5, 3]" in str(receiver["wrong_shape"])


def test_the_poll_before_sleeping_needs_a_core_per_local_process(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert spin_s() == SPIN_US * 1e-6
    monkeypatch.setenv(SPIN_ENV, "250")
    assert spin_s() == pytest.approx(250e-6)
    monkeypatch.setenv(SPIN_ENV, "1e9")  # never longer than the liveness check's interval
    assert spin_s() == LIVENESS_S
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))  # more processes than cores: never poll
    assert spin_s() == 0.0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not launched by torchrun or ringtree: never poll
    assert spin_s() == 0.0
    for bad in ("fast", "-5", "inf"):  # refused whatever the cores
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ValueError, match=f"{SPIN_ENV}='{bad}' is not a number of microseconds"):
            spin_s()
