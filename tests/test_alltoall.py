"""all_to_all: its schedules as data for p = 1..9, then every algorithm against torch in spawned worlds."""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from alltoall_checks import against_torch, gradients_against_torch

from ringtree import comm, schedules
from ringtree.comm import alltoall, exchange
from ringtree.processes import spawn
from ringtree.schedules import Op, OpKind, Schedule
from ringtree.schedules.verify import ScheduleError, dry_run
from ringtree.topology import Topology

ALGORITHMS = schedules.algorithms("all_to_all")


def build(algorithm: str, p: int, splits: tuple[int, ...], local: int | None = None) -> Schedule:
    topology = Topology(p, local or p)
    return schedules.build(schedules.Request("all_to_all", algorithm, topology, sum(splits), 4, 0, splits))


def matrices(p: int) -> list[tuple[int, ...]]:
    """Equal, uneven with zero blocks, and one rank that sends nothing."""
    rnd = random.Random(p)
    uneven = tuple(rnd.choice((0, 1, 2, 5)) for _ in range(p * p))
    silent = tuple(0 if k // p == p - 1 else 1 + k % 3 for k in range(p * p))
    return [(3,) * (p * p), uneven, silent, (0,) * (p * p)]


def locals_of(p: int) -> list[int]:
    return sorted({p, *(d for d in (2, 3) if p % d == 0)})


@pytest.mark.parametrize("p", range(1, 10))
def test_every_schedule_delivers_every_block_once(p: int) -> None:
    """Sends match receives step by step (no deadlock); each block reaches its destination, and
    no rank receives a block twice, for equal, uneven and empty splits."""
    for algorithm in ALGORITHMS:
        for splits in matrices(p):
            for local in locals_of(p) if algorithm == "hierarchical" else [p]:
                dry_run(build(algorithm, p, splits, local))


def simulate(s: Schedule, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Run every rank's steps in one process: what the executor's point-to-point path does."""
    p = s.world_size
    store = [exchange.Storage(s, r, inputs[r], outputs[r]) for r in range(p)]
    for r in range(p):
        exchange.copy_own_block(s, r, inputs[r], outputs[r])
    for t in range(s.num_steps):
        sent = {
            (r, op.peer, op.start): store[r].view(op).clone()
            for r in range(p)
            for op in s.steps[r][t]
            if op.kind is OpKind.SEND
        }
        for r in range(p):
            for op in s.steps[r][t]:
                if op.kind is OpKind.RECV:
                    store[r].view(op).copy_(sent[(op.peer, r, op.start)])


@pytest.mark.parametrize("p", range(2, 10))
def test_every_algorithm_moves_the_data_as_torch_defines_it(p: int) -> None:
    """Each rank's storage (input, output, forwarding scratch) run through the steps equals the
    definition: output block i of rank j is input block j of rank i."""
    for splits in matrices(p):
        rows = [list(splits[i * p : (i + 1) * p]) for i in range(p)]
        inputs = [torch.arange(sum(rows[r]), dtype=torch.float32) + 1000 * r for r in range(p)]
        pieces = [list(torch.split(inputs[r], rows[r])) for r in range(p)]
        want = [torch.cat([pieces[i][j] for i in range(p)]) for j in range(p)]
        for algorithm in ALGORITHMS:
            outputs = [torch.full_like(w, -1.0) for w in want]
            simulate(build(algorithm, p, splits, locals_of(p)[0]), inputs, outputs)
            assert all(torch.equal(o, w) for o, w in zip(outputs, want, strict=True)), (algorithm, splits)


def test_bruck_takes_log_p_steps_and_packs_half_the_blocks() -> None:
    for p, steps in ((2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)):
        s = build("bruck", p, (1,) * (p * p))
        assert s.num_steps == steps
        assert all(len({op.peer for op in step if op.kind is OpKind.SEND}) == 1 for step in s.steps[0])
    assert build("pairwise", 6, (1,) * 36).num_steps == 5
    assert build("linear", 6, (1,) * 36).num_steps == 1
    hier = build("hierarchical", 8, (1,) * 64, 4)
    across = [op for op in hier.steps[0][1] if op.kind is OpKind.SEND]
    assert {op.peer for op in across} == {4} and len(across) == 4  # one peer, four ranks' blocks


def test_the_verifier_catches_broken_all_to_all_schedules() -> None:
    s = build("pairwise", 3, (2,) * 9)
    steps = [list(map(list, r)) for r in s.steps]
    assert steps[0][0].pop(0).kind is OpKind.SEND  # a send whose receiver waits forever

    def rebuilt(rows: list[list[list[Op]]]) -> Schedule:
        return dataclasses.replace(s, steps=tuple(tuple(tuple(st) for st in r) for r in rows))

    with pytest.raises(ScheduleError, match="unmatched"):
        dry_run(rebuilt(steps))
    twice = [list(map(list, r)) for r in s.steps]
    extra = next(op for op in twice[0][0] if op.kind is OpKind.SEND)
    twice[0].append([extra])
    twice[extra.peer].append([Op(OpKind.RECV, 0, extra.start, extra.stop)])
    for r in range(3):
        while len(twice[r]) < 3:
            twice[r].append([])
    with pytest.raises(ScheduleError, match="already holds"):
        dry_run(rebuilt(twice))
    short = [[st for st in r[:1]] for r in s.steps]  # the second round never happens
    with pytest.raises(ScheduleError, match="ends with"):
        dry_run(rebuilt([[list(st) for st in r] for r in short]))


def test_auto_takes_bruck_for_tiny_blocks_on_many_ranks_and_linear_otherwise() -> None:
    assert alltoall.choose(64, 64, shared_memory=False) == "bruck"
    assert alltoall.choose(64, 1 << 20, shared_memory=False) == "linear"
    assert alltoall.choose(8, 64, shared_memory=False) == "linear"  # too few ranks to gain
    assert alltoall.choose(64, 64, shared_memory=True) == "linear"
    assert alltoall.cost_s("bruck", 8, 64) < alltoall.cost_s("pairwise", 8, 64)  # fewer rounds
    assert comm.algorithms("all_to_all") == ["native", "pairwise", "bruck", "linear", "hierarchical"]


def test_a_known_split_matrix_must_match_the_rank_s_own_sizes() -> None:
    matrix = [[1, 2], [3, 4]]
    assert alltoall._known(matrix, 1, (3, 4), (2, 4)) == [(1, 2), (3, 4)]
    with pytest.raises(ValueError, match="row 1 \\[3, 4\\] and column 1 \\[2, 4\\]"):
        alltoall._known(matrix, 1, (3, 4), (2, 5))
    with pytest.raises(ValueError, match="2 rows of 2 sizes"):
        alltoall._known([[1, 2]], 0, (1, 2), (1, 2))


def checks(rank: int, transport: str) -> list[str]:
    os.environ["RINGTREE_TRANSPORT"] = transport
    return against_torch(rank) + gradients_against_torch(rank)


def test_every_algorithm_matches_torch_over_shared_memory_on_two_nodes() -> None:
    """4 ranks as 2 nodes of 2 (hierarchical takes two hops)."""
    assert spawn(checks, 4, ("shm",), local_world_size=2, timeout_s=120) == [[]] * 4


def test_every_algorithm_matches_torch_over_shared_memory_on_one_host() -> None:
    """3 ranks of one host: linear (and auto) copy straight out of the peers' regions."""
    assert spawn(checks, 3, ("shm",), timeout_s=120) == [[]] * 3


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (comm.MismatchError, comm.CollectiveError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def checks_and_mismatches(rank: int) -> tuple[list[str], dict[str, str]]:
    failures = checks(rank, "p2p")
    x = torch.arange(6.0)
    out = torch.empty(6)
    wrong = [2, 2, 2] if rank != 1 else [1, 2, 3]  # rank 1 sends rank 0 one row, rank 0 expects 2
    return failures, {
        "splits": _error(lambda: comm.all_to_all_single(out, x, [2, 2, 2], wrong)),
        "algorithm": _error(
            lambda: comm.all_to_all_single(out, x, algorithm="bruck" if rank == 2 else "pairwise")
        ),
        "rows": _error(lambda: comm.all_to_all_single(out, x, [2, 2, 2], [2, 2, 1])),
    }


def test_every_algorithm_matches_torch_over_gloo_and_mismatches_name_the_ranks() -> None:
    results = spawn(checks_and_mismatches, 3, timeout_s=120)
    assert [failures for failures, _ in results] == [[]] * 3
    for rank, (_, r) in enumerate(results):
        assert "MismatchError: all_to_all: rank 1 sends rank 0 1 rows" in r["splits"], r
        assert "different algorithm" in r["algorithm"] and "rank 2 differs" in r["algorithm"], r
        assert r["rows"].startswith("ValueError") and "add up to the 6 rows" in r["rows"], (rank, r)


def dies(rank: int, transport: str) -> str:
    os.environ["RINGTREE_TRANSPORT"] = transport
    x, out = torch.arange(12.0), torch.empty(12)
    comm.all_to_all_single(out, x, algorithm="pairwise")
    if rank == 2:
        dist.barrier()
        os._exit(0)
    dist.barrier()
    time.sleep(0.5)
    start = time.monotonic()
    message = _error(lambda: comm.all_to_all_single(out, x, algorithm="pairwise", validate=False))
    return f"{time.monotonic() - start:.1f} {message}"


@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_a_dead_peer_is_named_within_the_timeout(transport: str) -> None:
    results = spawn(dies, 3, (transport,), timeout_s=90, allow_missing=True)
    for message in (results[0], results[1]):
        seconds, _, text = message.partition(" ")
        assert "CollectiveError" in text and "rank 2" in text, text
        assert float(seconds) < 30, message
