"""Bad input and faults: a clear error on every rank, within a timeout, never a hang."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.launch import spawn


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


def dead_peer(rank: int, algorithm: str) -> tuple[str, float]:
    """Rank 3 dies in the second step of the collective; the others must raise, not hang.

    (A rank that already holds everything it needs would finish correctly: here none does.)
    """
    if rank == 3:
        import ringtree.comm.executor as executor

        real = executor._wait_one  # gloo runs the pipelined path, which waits op by op

        def dying(work: Any, peer: int, sending: bool, t: int, *args: Any, **kwargs: Any) -> None:
            if t >= 1:  # its step-1 operations are posted, then it dies before they complete
                os._exit(0)
            real(work, peer, sending, t, *args, **kwargs)

        executor._wait_one = dying
    start = time.monotonic()
    message = _error(
        lambda: comm.all_reduce(torch.ones(1 << 16), algorithm=algorithm, timeout_s=10, validate=False)
    )
    return message, time.monotonic() - start


@pytest.mark.parametrize("algorithm", ["ring", "double_tree"])
def test_a_peer_dying_mid_collective_raises_on_every_live_rank(algorithm: str) -> None:
    results = spawn(dead_peer, 4, (algorithm,), timeout_s=90, allow_missing=True)
    assert results[3] is None  # it died
    for message, elapsed in results[:3]:
        assert message.startswith("CollectiveError"), message
        assert f"all_reduce(algorithm='{algorithm}'" in message and "step" in message
        assert elapsed < 20  # the 10 s timeout, or sooner when the transport notices the death


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
        assert elapsed < 5


def test_collectives_need_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm.all_reduce(torch.ones(2))
