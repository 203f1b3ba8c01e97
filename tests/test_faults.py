"""Bad input and faults: a clear error on every rank, within a timeout, never a hang."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.comm import flight_recorder, shm
from ringtree.processes import elastic_spawn, restart_count, spawn


def _error(fn: Any) -> str:
    """The type and message fn raised, or 'no error'."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def mismatch_cases(rank: int) -> dict[str, str]:
    """Each case is called by every rank; the handshake must fail identically everywhere."""
    out = {}
    n = 5 if rank == 1 else 4
    out["count"] = _error(lambda: comm.all_reduce(torch.ones(n), algorithm="ring"))
    dtype = torch.float64 if rank == 2 else torch.float32
    out["dtype"] = _error(lambda: comm.all_reduce(torch.ones(4, dtype=dtype), algorithm="tree"))
    algorithm = "tree" if rank == 0 else "ring"
    out["algorithm"] = _error(lambda: comm.all_reduce(torch.ones(4), algorithm=algorithm))
    op = "max" if rank == 0 else "sum"
    out["op"] = _error(lambda: comm.all_reduce(torch.ones(4), op=op))
    # Mistakes every rank makes alike are caught before any communication.
    out["unknown algorithm"] = _error(lambda: comm.all_reduce(torch.ones(4), algorithm="butterfly"))
    out["unknown op"] = _error(lambda: comm.all_reduce(torch.ones(4), op="mean"))
    out["avg of ints"] = _error(lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), op="avg"))
    out["block size"] = _error(lambda: comm.reduce_scatter(torch.empty(2), torch.ones(7)))
    out["root"] = _error(lambda: comm.broadcast(torch.ones(4), src=9))
    out["not a tensor"] = _error(lambda: comm.all_reduce([1.0, 2.0]))  # type: ignore[arg-type]
    # After all that the world still works.
    out["after"] = str(comm.all_reduce(torch.ones(3), algorithm="double_tree").tolist())
    return out


def test_mismatches_and_bad_arguments_raise_on_every_rank() -> None:
    results = spawn(mismatch_cases, 3, timeout_s=90)
    for rank, out in enumerate(results):
        assert "MismatchError" in out["count"] and "rank 1: 5" in out["count"] and "rank 0: 4" in out["count"]
        assert "dtype" in out["dtype"] and "rank 2: float64" in out["dtype"]
        assert "algorithm" in out["algorithm"] and "rank 0: tree" in out["algorithm"]
        assert "op" in out["op"] and "rank 0: max" in out["op"]
        assert "ValueError" in out["unknown algorithm"] and "double_tree" in out["unknown algorithm"]
        assert "ValueError" in out["unknown op"] and "product" in out["unknown op"]
        assert "TypeError" in out["avg of ints"]
        assert "ValueError" in out["block size"] and "3 x 2 = 6" in out["block size"]
        assert "root rank 9" in out["root"]
        assert "TypeError" in out["not a tensor"]
        assert out["after"] == "[3.0, 3.0, 3.0]", rank


def dead_peer(rank: int, algorithm: str, transport: str) -> tuple[str, float]:
    """Rank 3 dies in the second step of the collective; the others must raise, not hang.

    (A rank that already holds everything it needs would finish correctly: here none does.)
    """
    os.environ[shm.TRANSPORT_ENV] = transport
    if rank == 3:
        import ringtree.comm.executor as executor

        real = executor.wait_step

        def dying(works: Any, step: Any, t: int, *args: Any, **kwargs: Any) -> None:
            if t >= 1:  # its step-1 operations are posted, then it dies before they complete
                os._exit(0)
            real(works, step, t, *args, **kwargs)

        real_one = executor._wait_one

        def dying_one(work: Any, peer: int, sending: bool, t: int, *args: Any) -> None:
            if t >= 1:  # the pipelined (gloo) path: dies once its step-1 pieces are posted
                os._exit(0)
            real_one(work, peer, sending, t, *args)

        real_sync = shm._Doorbells.sync

        def dying_sync(self: shm._Doorbells, timeout: Any, peers: Any = None) -> None:
            if self.epoch >= 2:  # shared memory: dies after step 0, without ringing
                os._exit(0)
            real_sync(self, timeout, peers)

        executor.wait_step = dying
        executor._wait_one = dying_one
        shm._Doorbells.sync = dying_sync  # type: ignore[method-assign]
    start = time.monotonic()
    message = _error(
        lambda: comm.all_reduce(torch.ones(1 << 16), algorithm=algorithm, timeout_s=10, validate=False)
    )
    return message, time.monotonic() - start


@pytest.mark.parametrize("transport", ["p2p", "shm"])
@pytest.mark.parametrize("algorithm", ["ring", "double_tree"])
def test_a_peer_dying_mid_collective_raises_on_every_live_rank(algorithm: str, transport: str) -> None:
    results = spawn(dead_peer, 4, (algorithm, transport), timeout_s=90, allow_missing=True)
    assert results[3] is None  # it died
    for message, elapsed in results[:3]:
        assert message.startswith("CollectiveError"), message
        assert f"all_reduce(algorithm='{algorithm}'" in message and "step" in message
        assert elapsed < 20  # the 10 s timeout, or sooner when the transport notices the death


class _Gone:
    """A process group whose peer's connection is gone: gloo raises as the operation is posted."""

    def send(self, *args: object) -> object:
        raise RuntimeError("Read error [127.0.0.1]:23216: Connection reset by peer")

    recv = send


def posting_fails(rank: int) -> str:
    """Gloo raises at once (not in wait) when a peer died: the executor names it like a wait's failure."""
    from datetime import timedelta

    from ringtree.comm import executor, reduce_ops
    from ringtree.schedules import Request, build
    from ringtree.topology import Topology

    schedule = build(Request("all_reduce", "ring", Topology.single_node(2), 1 << 10, 4))
    buf = torch.ones(1 << 10)
    gone: Any = _Gone()
    return _error(
        lambda: executor._pipelined(
            buf,
            schedule,
            rank,
            reduce_ops.COMBINE["sum"],
            gone,
            [0, 1],
            timedelta(seconds=5),
            "ringtree test",
        )
    )


def test_a_send_that_fails_as_it_is_posted_is_a_collective_error() -> None:
    for rank, message in enumerate(spawn(posting_fails, 2, timeout_s=60)):
        assert message.startswith("CollectiveError"), message
        assert f"ringtree test on rank {rank} receiving from rank {1 - rank} failed at step 1/" in message
        assert "Connection reset by peer" in message


def silent_peer(rank: int) -> tuple[str, float]:
    """Rank 2 never calls the collective; ranks 0 and 1 must time out, in the handshake or the steps."""
    if rank == 2:
        time.sleep(6)
        return "skipped", 0.0
    start = time.monotonic()
    message = _error(lambda: comm.all_reduce(torch.ones(8), timeout_s=1.5, validate=rank == 0))
    return message, time.monotonic() - start


def test_a_silent_peer_times_out() -> None:
    results = spawn(silent_peer, 3, timeout_s=60)
    for message, elapsed in results[:2]:
        assert message.startswith("CollectiveError") and "timed out" in message, message
        assert "Culprit: rank 2 never called a collective" in message, message
        assert elapsed < 5


def skipping_peer(rank: int, folder: str, validate: bool) -> tuple[str, list[str]]:
    """Everyone all-reduces once; then rank 2 skips the second all-reduce and goes quiet."""
    os.environ[flight_recorder.DUMP_DIR_ENV] = folder
    comm.all_reduce(torch.ones(8), algorithm="ring")
    if rank == 2:
        time.sleep(5)
        return "skipped", []
    message = _error(lambda: comm.all_reduce(torch.ones(8), timeout_s=1.5, validate=validate))
    return message, [r.state for r in flight_recorder.RECORDER.records]


@pytest.mark.parametrize("validate", [True, False])
def test_a_hang_names_the_rank_that_skipped_a_collective(tmp_path: Any, validate: bool) -> None:
    results = spawn(skipping_peer, 3, (str(tmp_path), validate), timeout_s=60)
    for rank, (message, states) in enumerate(results[:2]):
        assert message.startswith("CollectiveError"), message
        assert "Culprit: rank 2 lags: its latest collective is #1 (all_reduce" in message, message
        assert f"rank {rank} waits in #2 (all_reduce)" in message, message
        assert states == ["completed", "failed"]
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["seq"] for r in record["records"]] == [1, 2]
        assert str(tmp_path / f"rank{rank}.json") in message


def reordering_peer(rank: int) -> str:
    """Rank 2 broadcasts where the others all-reduce: the handshake names it at once."""
    x = torch.ones(8)
    call = (lambda: comm.broadcast(x, 0)) if rank == 2 else (lambda: comm.all_reduce(x))
    return _error(call)


def test_a_reordered_collective_is_named_by_the_handshake() -> None:
    for message in spawn(reordering_peer, 3, timeout_s=60):
        assert message.startswith("MismatchError"), message
        assert "rank 2: broadcast" in message and "rank 2 differs" in message, message
        assert "same collectives in the same order" in message


def test_collectives_need_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm.all_reduce(torch.ones(2))


def killed_once(rank: int, folder: str) -> tuple[int, float]:
    """Rank 1 kills itself (SIGKILL) in the middle of its first attempt's work."""
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1 and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x)
    return restart_count(), float(x[0])


def test_a_killed_worker_is_restarted_by_the_elastic_agent(tmp_path: Any) -> None:
    results = elastic_spawn(killed_once, 2, (str(tmp_path),), max_restarts=1)
    assert results == [(1, 4.0), (1, 4.0)]  # both ranks ran a second attempt to the end
