"""The shared-memory transport: plans (pure) and every schedule over it against torch (3 ranks)."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_checks import against_torch

from ringtree import comm, schedules
from ringtree.comm import shm
from ringtree.comm.reduce_ops import COMBINE
from ringtree.parallel import DistributedDataParallel, placement
from ringtree.processes import spawn
from ringtree.schedules.base import Builder
from ringtree.topology import Topology


def ring(p: int, count: int) -> schedules.Schedule:
    return schedules.build(schedules.Request("all_reduce", "ring", Topology.single_node(p), count, 4))


def test_ring_plan_copies_one_block_in_and_p_minus_1_blocks_out() -> None:
    plan = shm._compile(ring(4, 4000), 1)
    size = lambda ranges: sum(b - a for a, b in ranges)  # noqa: E731
    # one block in: the block rank 1 sends before it writes it
    assert len(plan.copy_in) == 1 and size(plan.copy_in) == 1000
    # p - 1 final blocks out: its own reduced block and the blocks it forwards in the all-gather;
    # the last block it receives is read by nobody and goes straight to the caller's tensor
    assert size(plan.copy_out) == 3000
    assert plan.steps[-1][0].start not in [a for a, _ in plan.copy_out]
    first = plan.steps[0][0]
    assert first.reduce and not first.from_shared and first.to_shared  # combined from the caller's
    last = plan.steps[-1][0]
    assert not last.reduce and not last.to_shared
    assert not plan.staged


def test_a_step_that_receives_into_what_it_sends_is_staged() -> None:
    b = Builder(2)
    b.transfer(0, 0, 1, 0, 8, True)
    b.transfer(0, 1, 0, 0, 8, True)
    s = b.build("exchange", "all_reduce", 8)
    assert shm._compile(s, 0).staged == frozenset({0})
    assert shm._compile(ring(2, 8), 0).staged == frozenset()


def test_a_ring_rank_meets_only_its_two_neighbours_inside_a_call() -> None:
    assert shm._compile(ring(5, 5000), 0).neighbours == (1, 4)
    assert shm._compile(ring(5, 5000), 3).neighbours == (2, 4)


@pytest.mark.parametrize("p", [5, 6])
def test_every_schedule_s_neighbours_are_symmetric(p: int) -> None:
    """Barriers among neighbours count per pair: q meets r as often as r meets q only if the
    relation is symmetric, in every collective and algorithm (and at every root)."""
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        for algorithm in schedules.algorithms(collective):
            for root in (0, p - 1):
                topology = Topology(p, p // 2 if p % 2 == 0 else p)
                request = schedules.Request(collective, algorithm, topology, 60 * p, 4, root)
                s = schedules.build(request)
                near = [set(shm._compile(s, r).neighbours) for r in range(p)]
                assert all((q in near[r]) == (r in near[q]) for r in range(p) for q in range(p)), (
                    collective,
                    algorithm,
                )


def test_transport_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm.TRANSPORT_ENV, "tcp")
    with pytest.raises(ValueError, match="'tcp' is not a transport; use one of shm, p2p"):
        shm.transport()


def _ours() -> list[str]:
    return sorted(f.name for f in Path("/dev/shm").glob(f"ringtree-{os.getpid()}-*"))


def every_collective_over_shm(rank: int) -> dict[str, object]:
    os.environ[shm.TRANSPORT_ENV] = "shm"
    p, failures = dist.get_world_size(), against_torch(rank, 2003)
    # a hand-made step that reduces into the range it sends: staged reads
    b = Builder(p)
    for r in range(p):
        b.transfer(0, r, (r + 1) % p, 0, 64, True)
    y = torch.full((64,), float(rank + 1))
    shm.execute(y, b.build("x", "all_reduce", 64), rank, COMBINE["sum"], pg=_world(), timeout=_t(), what="x")
    if not torch.equal(y, torch.full((64,), float(rank + 1 + (rank - 1) % p + 1))):
        failures.append(f"staged step gave {y[0].item()}")
    x = torch.ones(2003)
    used = shm.usable(x.device, _world(), _t())
    os.environ[shm.TRANSPORT_ENV] = "p2p"
    off = shm.usable(x.device, _world(), _t())
    return {"failures": failures, "used": used, "off": off, "left": _ours()}


def _world() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def _t() -> timedelta:
    return timedelta(seconds=30)


def test_every_collective_over_shared_memory_matches_torch() -> None:
    results = spawn(every_collective_over_shm, 3, timeout_s=180)
    assert [r["failures"] for r in results] == [[], [], []]
    assert all(r["used"] and not r["off"] for r in results)
    assert all(r["left"] == [] for r in results)  # every file unlinked once mapped


def different_hosts(rank: int) -> tuple[bool, bool]:
    os.environ[shm.TRANSPORT_ENV] = "shm"
    real = shm.host_key()
    assert real is not None
    shm.host_key = lambda: [f"node{rank}", *real[1:]]  # type: ignore[assignment]
    x = torch.ones(1 << 18)
    x = torch.ones(2003)
    used = shm.usable(x.device, _world(), _t())
    comm.all_reduce(x, algorithm="ring")
    return used, bool((x == 2).all())


def test_ranks_on_different_hosts_stay_on_gloo() -> None:
    assert spawn(different_hosts, 2, timeout_s=120) == [(False, True), (False, True)]


def one_rank_skips(rank: int) -> str:
    os.environ[shm.TRANSPORT_ENV] = "shm"
    x = torch.ones(1 << 10)
    comm.all_reduce(x, algorithm="ring")  # both ranks: the shared buffers and doorbells are set up
    if rank == 1:
        import time

        time.sleep(6)  # never calls the second all-reduce
        return ""
    try:
        comm.all_reduce(x, algorithm="ring", timeout_s=2, validate=False)
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


def test_a_rank_that_never_comes_is_named_after_the_timeout() -> None:
    message = spawn(one_rank_skips, 2, timeout_s=60)[0]
    assert "over shared memory failed or timed out" in message
    assert "Timed out waiting for rank(s) [1]" in message


def timed_ring_call(x: torch.Tensor) -> str:
    """A ring all-reduce that is expected to fail: seconds until its error, then the error."""
    start = time.monotonic()
    try:
        comm.all_reduce(x, algorithm="ring", timeout_s=30, validate=False)
    except comm.CollectiveError as e:
        return f"{time.monotonic() - start:.1f} {e}"
    return "no error"


def one_rank_dies(rank: int) -> str:
    x = torch.ones(1 << 10)
    comm.all_reduce(x, algorithm="ring")
    if rank == 1:
        os._exit(0)
    return timed_ring_call(x)


def test_a_rank_that_dies_is_named_at_once() -> None:
    message = spawn(one_rank_dies, 2, timeout_s=60, allow_missing=True)[0]
    seconds, _, text = message.partition(" ")
    assert "rank 1 (pid" in text and "exited while this rank waited for it" in text
    assert float(seconds) < 10  # not the 30 s timeout


def non_neighbour_dies(rank: int) -> str:
    """5 ranks: rank 2 dies inside a ring call, after its first barrier, without ringing again."""
    x = torch.ones(1 << 10)
    comm.all_reduce(x, algorithm="ring")
    if rank == 2:
        bells = shm._group(_world(), _t()).bells
        assert bells is not None
        real, met = shm._Doorbells.sync, bells.epoch

        def dying(self: shm._Doorbells, timeout: timedelta, *peers: object) -> None:
            if self.epoch > met:  # past the next call's first barrier (every rank)
                os._exit(0)
            real(self, timeout, *peers)  # type: ignore[arg-type]

        shm._Doorbells.sync = dying  # type: ignore[method-assign]
    return timed_ring_call(x)


def in_place_rank_dies(rank: int) -> str:
    """4 ranks reduce a tensor in shared memory (signals, not barriers); rank 1 exits between two
    in-place calls, so the others wait on its signal for the second."""
    buf = shm.shared_buffer(1 << 10, torch.float32, _world(), _t())
    assert buf is not None
    buf.fill_(1.0)
    comm.all_reduce(buf, algorithm="ring", validate=False)
    if rank == 1:
        os._exit(0)
    return timed_ring_call(buf)


def test_a_rank_that_dies_between_in_place_calls_is_named_at_once() -> None:
    messages = spawn(in_place_rank_dies, 4, timeout_s=60, allow_missing=True)
    live = [m for r, m in enumerate(messages) if r != 1 and m is not None]
    assert live and all("rank 1 (pid" in m for m in live), live
    assert all(float(m.partition(" ")[0]) < 10 for m in live)  # not the 30 s timeout


def test_a_rank_that_dies_is_named_by_ranks_that_do_not_wait_for_it() -> None:
    """Rank 0 meets only ranks 1 and 4 inside a 5-rank ring call: when they give up (rank 2 died
    before ringing them) and exit, it names them and rank 2 at once."""
    message = spawn(non_neighbour_dies, 5, timeout_s=60, allow_missing=True)[0]
    seconds, _, text = message.partition(" ")
    assert "exited while this rank waited for it" in text and "rank 2 (pid" in text, text
    assert float(seconds) < 10  # not the 30 s timeout


def shm_with_a_late_rank(rank: int, late_rank: int, delay_s: float) -> None:
    """The shared-memory transport, with `late_rank` sleeping `delay_s` after every barrier."""
    os.environ[shm.TRANSPORT_ENV] = "shm"
    if rank == late_rank:
        real = shm._Group.sync

        def late(self: shm._Group, *args: object) -> None:
            real(self, *args)  # type: ignore[arg-type]
            time.sleep(delay_s)

        shm._Group.sync = late  # type: ignore[method-assign]


def back_to_back(rank: int, late_rank: int = 1, algorithms: tuple[str, ...] = ("ring",)) -> list[str]:
    """A late reader: rank 1 sleeps after every barrier, so the others start the next call (and
    write their buffers) while it still reads the last step of this one."""
    shm_with_a_late_rank(rank, late_rank, 0.003)
    p, failures = dist.get_world_size(), []
    n = 999  # one size: a ring rank's first write (copy in) is the range its successor reads last
    for i in range(12):
        algorithm = algorithms[i % len(algorithms)]
        x = torch.arange(n, dtype=torch.float32) + 1000 * rank + i
        comm.all_reduce(x, algorithm=algorithm, validate=False)
        want = p * torch.arange(n, dtype=torch.float32) + 1000 * sum(range(p)) + p * i
        if not torch.equal(x, want):
            failures.append(f"call {i} ({algorithm}): {int((x != want).sum())} wrong elements")
    return failures


def test_back_to_back_calls_with_a_late_reader_stay_exact() -> None:
    assert spawn(back_to_back, 3, timeout_s=120) == [[], [], []]


def test_a_late_rank_beyond_the_neighbours_stays_exact() -> None:
    """5 ranks: inside a call the ring's ranks wait only for their two neighbours, so rank 0
    runs ahead of late rank 2 (not its neighbour); the results stay exact, also when calls of
    other algorithms (other neighbours) come in between."""
    algorithms = ("ring", "halving_doubling", "ring", "double_tree", "ring", "bfb")
    assert spawn(back_to_back, 5, (2, algorithms), timeout_s=120) == [[]] * 5


def in_place(rank: int, late_rank: int) -> list[str]:
    """Tensors in shared memory are reduced where they lie, every algorithm bitwise as torch's; a
    late rank still reading its neighbours' tensors never sees them rewritten for the next call."""
    shm_with_a_late_rank(rank, late_rank, 0.002)
    p, n, failures = dist.get_world_size(), 2003, []
    for dtype in (torch.float32, torch.int32):
        buf = shm.shared_buffer(n + 5, dtype, _world(), _t())
        assert buf is not None
        x = buf[5:]  # a slice at an offset: every rank's at the same one

        def values(r: int, i: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.arange(n) * (r + 1 + i) % 17 - 8).to(dtype)  # small integers: exact sums

        # nothing between two calls waits for the late rank: each input is written right after
        for i, algorithm in enumerate(comm.algorithms("all_reduce")[1:] * 2):
            x.copy_(values(rank, i))
            comm.all_reduce(x, algorithm=algorithm, validate=False)
            want = sum(values(r, i) for r in range(p))
            if not torch.equal(x, want):
                failures.append(f"{algorithm} {dtype}: {int((x != want).sum())} wrong elements")
    group = shm._group(_world(), _t())
    if not group.placed:
        failures.append("no call ran in place")
    if (writes := _pipe_writes_of_a_ring_call(x)) != 7:  # 15 with a barrier after every step
        failures.append(f"an in-place 4-rank ring call rang {writes} pipes, not 7")
    allowed = os.sched_getaffinity(0)
    ddp = DistributedDataParallel(torch.nn.Linear(8, 4), bucket_cap_mb=1e-4)  # ring: shared buckets
    core = placement.core_for(rank, p, allowed, os.cpu_count() or 1)  # 4 ranks on 2 cores: pinned
    if os.sched_getaffinity(0) != (allowed if core is None else {core}):
        failures.append(f"rank {rank} runs on {os.sched_getaffinity(0)}, expected core {core}")
    native = DistributedDataParallel(torch.nn.Linear(8, 4), algorithm="native")
    if not all(b.buffer.data_ptr() in group.arenas for b in ddp.buckets):
        failures.append("ring DDP buckets are not in shared memory")
    if any(b.buffer.data_ptr() in group.arenas for b in native.buckets):
        failures.append("native DDP buckets are in shared memory")
    yields = [_yields_per_step(ddp), _yields_per_step(native)]
    if yields != [3, 0]:  # ranks sharing the host's cores: a forward and 2 gradients
        failures.append(f"sched_yield calls per step (ring, native): {yields}")
    ddp.close()
    native.close()
    if os.sched_getaffinity(0) != allowed:
        failures.append("closing the DDP did not give the rank its cores back")
    kept = [b.buffer.data_ptr() for b in ddp.buckets]
    del ddp, native
    gc.collect()
    with group.lock:
        group.arena_of(0, 0)  # purges what was collected
        if any(base in group.arenas for base in kept):
            failures.append("a collected DDP's shared buckets are still registered")
    return failures


def _pipe_writes_of_a_ring_call(x: torch.Tensor) -> int:
    writes = []
    real = os.write

    def counted(fd: int, data: bytes) -> int:
        writes.append(fd)
        return real(fd, data)

    os.write = counted  # type: ignore[assignment]
    try:
        comm.all_reduce(x, algorithm="ring", validate=False)
    finally:
        os.write = real  # type: ignore[assignment]
    return len(writes)


def _yields_per_step(ddp: DistributedDataParallel) -> int:
    calls = []
    real, os.sched_yield = os.sched_yield, lambda: calls.append(1)  # type: ignore[assignment]
    try:
        ddp(torch.ones(2, 8)).sum().backward()
    finally:
        os.sched_yield = real  # type: ignore[assignment]
    return len(calls)


def test_tensors_in_shared_memory_are_reduced_in_place() -> None:
    assert spawn(in_place, 4, (2,), timeout_s=120) == [[]] * 4


def test_without_shared_memory_there_is_no_shared_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "usable", lambda *a: False)
    assert shm.shared_buffer(4, torch.float32, None, _t()) is None  # type: ignore[arg-type]


def full_dev_shm(rank: int) -> list[bool]:
    os.environ[shm.TRANSPORT_ENV] = "shm"
    real = os.posix_fallocate

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    if rank == 1:
        os.posix_fallocate = full  # type: ignore[assignment]
    try:
        got = shm.shared_buffer(1 << 10, torch.float32, _world(), _t())
    finally:
        os.posix_fallocate = real
    x = torch.ones(10)
    comm.all_reduce(x, algorithm="ring")  # the transport's own buffers still work
    return [got is None, bool((x == 2).all()), _ours() == []]


def test_a_full_dev_shm_on_one_rank_gives_private_buffers_on_every_rank() -> None:
    assert spawn(full_dev_shm, 2, timeout_s=60) == [[True, True, True]] * 2


def waits_as_a_batch_thread(rank: int) -> tuple[list[int], int]:
    """Rank 1 comes late: rank 0 sleeps in the barrier; which policy it sleeps under, and after."""
    x = torch.ones(1 << 10)
    comm.all_reduce(x, algorithm="ring")  # both ranks: the shared buffers and doorbells are set up
    seen: list[int] = []
    real = shm.select.select

    def select(*args: Any) -> Any:
        seen.append(os.sched_getscheduler(0))
        return real(*args)

    shm.select.select = select  # type: ignore[assignment]
    if rank == 1:
        time.sleep(0.3)
    comm.all_reduce(x, algorithm="ring", validate=False)
    shm.select.select = real  # type: ignore[assignment]
    return seen, os.sched_getscheduler(0)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_a_rank_waits_for_its_peers_as_a_batch_thread() -> None:
    """A woken waiter queues for the core rather than preempting the peer that woke it; the
    thread's own policy is back once the call returns."""
    seen, after = spawn(waits_as_a_batch_thread, 2, timeout_s=60)[0]
    assert seen and all(policy == os.SCHED_BATCH for policy in seen)
    assert after == os.SCHED_OTHER
