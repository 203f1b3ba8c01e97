"""all_to_all_single: torch.distributed's signature, every algorithm, and an autograd form.

Rank i cuts its input along dimension 0 into p blocks of `input_split_sizes[j]` rows and sends
block j to rank j, which stores what it receives from rank i as its output's block i of
`output_split_sizes[i]` rows. Sizes None: equal blocks. Algorithms (`algorithms("all_to_all")`):
"native" (torch.distributed's own) and the schedules of `ringtree.schedules.alltoall`
(pairwise, bruck, linear, hierarchical), run by `ringtree.comm.exchange`. "auto" chooses by the
alpha-beta cost (`choose`).

With explicit split sizes every rank first all-gathers its sizes (p + p small integers; it
also checks, with validate=True, that the call agrees across ranks): the schedules of Bruck and
hierarchical forward other ranks' blocks, so every rank needs the whole matrix of sizes, as
MPICH's alltoallv exchanges counts. With equal splits nothing is exchanged unless validate=True.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtree import schedules
from ringtree.comm import exchange, shm
from ringtree.comm.collectives import (
    COLLECTIVES,
    DEFAULT_TIMEOUT_S,
    NATIVE,
    _Call,
    _contiguous,
    algorithms,
)
from ringtree.comm.errors import MismatchError
from ringtree.comm.reduce_ops import DTYPES
from ringtree.topology import Topology

AUTO = "auto"
COLLECTIVE = "all_to_all"

# The constants of the "auto" rule over point-to-point (gloo over TCP, NCCL): a round's latency
# (paid once by the messages posted together), each message's own overhead (serialised at the
# sender, as LogP's o) and the time per byte. Over shared memory auto is always "linear".
ALPHA_S = 20e-6
OVERHEAD_S = 5e-6
BETA_S_PER_BYTE = 1 / 5e9


def cost_s(algorithm: str, p: int, block_bytes: float) -> float:
    """Time of one all-to-all of `block_bytes` per pair, α a round's latency, o a message's
    overhead, β per byte, one port per rank:

    linear:   α + (p-1)·(o + m·β)                  every message posted at once, one round
    pairwise: (p-1)·(α + o + m·β)                  p-1 rounds of one message
    bruck:    ⌈lg p⌉·(α + o + ⌈p/2⌉·m·β)           ⌈lg p⌉ rounds of one message of about p/2 blocks
    (hierarchical on one node is linear).
    """
    if p <= 1:
        return 0.0
    m = block_bytes * BETA_S_PER_BYTE
    if algorithm == "bruck":
        return math.ceil(math.log2(p)) * (ALPHA_S + OVERHEAD_S + (p + 1) // 2 * m)
    if algorithm == "pairwise":
        return (p - 1) * (ALPHA_S + OVERHEAD_S + m)
    return ALPHA_S + (p - 1) * (OVERHEAD_S + m)


def choose(p: int, block_bytes: float, shared_memory: bool) -> str:
    """The "auto" rule: over shared memory "linear" (one barrier; every byte copied twice, the
    least any algorithm does); elsewhere "bruck" where its cost (`cost_s`) is below linear's
    (tiny blocks on many ranks: with these constants below 5-7 KB per block on 32 ranks or more,
    never on 16 or fewer; MPICH switches below 256 bytes), else "linear" (pairwise never costs
    less in this model)."""
    if shared_memory or p <= 2:
        return "linear"
    return "bruck" if cost_s("bruck", p, block_bytes) < cost_s("linear", p, block_bytes) else "linear"


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    algorithm: str = AUTO,
    group: dist.ProcessGroup | None = None,
    *,
    topology: Topology | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
    split_matrix: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Scatter `input`'s dim-0 blocks to the ranks and gather theirs into `output`; returns output.

    split_matrix: every rank's input_split_sizes (row i: what rank i sends each rank), where
    every rank already knows them (MoE, after exchanging its token counts): the schedules then
    need no size exchange; with validate=False nothing is exchanged at all.

    validate=True checks, in the same small all-gather that shares the split sizes, that every
    rank called all_to_all with the same dtype, row shape and algorithm, and that what rank i
    sends rank j (its input_split_sizes[j]) is what rank j expects (its output_split_sizes[i]);
    it raises MismatchError on every rank naming the ranks that disagree.
    """
    valid = [*algorithms(COLLECTIVE), AUTO]
    call = _Call(COLLECTIVE, algorithm, input, "sum", group, topology, timeout_s, valid=valid)
    p = call.world_size
    _check_tensors(input, output)
    row = math.prod(input.shape[1:])
    sends = _rows(input, input_split_sizes, p, "input")
    receives = _rows(output, output_split_sizes, p, "output")
    explicit = input_split_sizes is not None or output_split_sizes is not None
    known = None if split_matrix is None else _known(split_matrix, call.rank, sends, receives)
    with call:
        if validate or (explicit and known is None and algorithm != NATIVE):
            table = _exchange(call, valid, row, sends, receives)
        elif known is not None:
            table = [list(r) for r in known]
        else:
            table = [[input.shape[0] // p] * p for _ in range(p)]
        matrix = tuple(table[i][j] * row for i in range(p) for j in range(p))
        if algorithm == AUTO:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            mean = sum(matrix) * input.element_size() / (p * p)
            algorithm = choose(p, mean, p > 1 and shm.usable(input.device, pg, call.timeout))
            call.algorithm = algorithm
        if algorithm == NATIVE:
            out = output if output.is_contiguous() else output.contiguous()
            work = dist.all_to_all_single(
                out, input.contiguous(), list(receives), list(sends), group=group, async_op=True
            )
            call.wait_native(work, "native")
            if out is not output:
                output.copy_(out)
            return output
        _run_schedule(call, algorithm, input, output, matrix)
        return output


def _run_schedule(
    call: _Call, algorithm: str, input: torch.Tensor, output: torch.Tensor, matrix: tuple[int, ...]
) -> None:
    """Build the schedule for the block matrix (elements) and run this rank's part of it."""
    flat_in = input.contiguous().view(-1)
    if output.data_ptr() == input.data_ptr() and output.numel():
        flat_in = flat_in.clone()
    pg = call.group if call.group is not None else dist.distributed_c10d._get_default_group()
    with _contiguous(output) as flat_out:
        if algorithm == "linear" and shm.usable(input.device, pg, call.timeout):
            what = _what(algorithm, flat_in)
            exchange.linear_shared(flat_in, flat_out, matrix, call.rank, pg, call.timeout, what)
            return
        request = schedules.Request(
            COLLECTIVE, algorithm, call.topology, sum(matrix), input.element_size(), 0, matrix
        )
        exchange.execute(
            flat_in,
            flat_out,
            schedules.build(request),
            call.rank,
            peers=call.peers,
            group=call.group,
            timeout=call.timeout,
            what=_what(algorithm, flat_in),
        )


def _what(algorithm: str, flat_in: torch.Tensor) -> str:
    return f"ringtree all_to_all(algorithm={algorithm!r}, count={flat_in.numel()})"


def _check_tensors(input: torch.Tensor, output: torch.Tensor) -> None:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"all_to_all needs torch.Tensor output, got {type(output).__name__}")
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all needs tensors of at least one dimension (blocks are cut along dim 0)")
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"all_to_all: input rows {tuple(input.shape[1:])} and output rows "
            f"{tuple(output.shape[1:])} differ; blocks are cut along dim 0 of equal rows"
        )
    if input.dtype != output.dtype:
        raise TypeError(f"all_to_all: input and output dtypes differ ({input.dtype} vs {output.dtype})")
    if input.device != output.device:
        raise ValueError(f"all_to_all: input on {input.device} but output on {output.device}")


def _rows(tensor: torch.Tensor, sizes: Sequence[int] | None, p: int, name: str) -> tuple[int, ...]:
    """The dim-0 block sizes of `tensor`: `sizes` checked, or equal blocks."""
    n = tensor.shape[0]
    if sizes is None:
        if n % p:
            raise ValueError(
                f"all_to_all: {name} has {n} rows, not divisible by the {p} ranks; "
                f"pass {name}_split_sizes for unequal blocks"
            )
        return (n // p,) * p
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != p or any(s < 0 for s in sizes) or sum(sizes) != n:
        raise ValueError(
            f"all_to_all: {name}_split_sizes {list(sizes)} must be {p} sizes >= 0 "
            f"that add up to the {n} rows of {name}"
        )
    return sizes


def _known(
    split_matrix: Sequence[Sequence[int]], rank: int, sends: tuple[int, ...], receives: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """The split matrix checked against this rank's own sizes (its row and its column)."""
    p = len(sends)
    known = [tuple(int(v) for v in r) for r in split_matrix]
    if len(known) != p or any(len(r) != p for r in known):
        raise ValueError(f"all_to_all: split_matrix must be {p} rows of {p} sizes, one row per rank")
    if known[rank] != sends or tuple(r[rank] for r in known) != receives:
        raise ValueError(
            f"all_to_all: split_matrix row {rank} {list(known[rank])} and column {rank} "
            f"{[r[rank] for r in known]} must be this rank's input and output split sizes "
            f"{list(sends)} and {list(receives)}"
        )
    return known


def _exchange(
    call: _Call, valid: list[str], row: int, sends: tuple[int, ...], receives: tuple[int, ...]
) -> list[list[int]]:
    """All-gather every rank's fields and split sizes; raise MismatchError where they disagree.

    Returns per rank its p input and p output block sizes (rows)."""
    p = call.world_size
    fields = {
        "collective": COLLECTIVES.index(COLLECTIVE),
        "sequence number": call.record.seq,
        "dtype": DTYPES.index(call.tensor.dtype),
        "algorithm": valid.index(call.algorithm),
        "row size": row,
    }
    if p == 1:
        return [[*sends, *receives]]
    mine = torch.tensor([*fields.values(), *sends, *receives], dtype=torch.int64, device=call.tensor.device)
    every = [torch.empty_like(mine) for _ in range(p)]
    call.wait_native(dist.all_gather(every, mine, group=call.group, async_op=True), "size exchange")
    table: list[list[int]] = torch.stack(every).cpu().tolist()
    for j, name in enumerate(fields):
        values = [r[j] for r in table]
        if len(set(values)) > 1:
            raise MismatchError(call._mismatch(name, values, valid))
    sizes = [r[len(fields) :] for r in table]
    for i in range(p):
        for j in range(p):
            sent, expected = sizes[i][j], sizes[j][p + i]
            if sent != expected:
                raise MismatchError(
                    f"all_to_all: rank {call.peers[i]} sends rank {call.peers[j]} {sent} rows "
                    f"(its input_split_sizes[{j}]) but rank {call.peers[j]} expects {expected} "
                    f"(its output_split_sizes[{i}]); the split sizes must agree pairwise"
                )
    return sizes


class _AllToAll(torch.autograd.Function):
    """Forward: the all-to-all; backward: the all-to-all of the gradient with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        algorithm: str,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits = (output_split_sizes, input_split_sizes, algorithm, group)
        rows = input.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        output = input.new_empty((rows, *input.shape[1:]))
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, algorithm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_split_sizes, input_split_sizes, algorithm, group = ctx.splits
        rows = grad.shape[0] if input_split_sizes is None else sum(input_split_sizes)
        grad_in = grad.new_empty((rows, *grad.shape[1:]))
        all_to_all_single(grad_in, grad.contiguous(), input_split_sizes, output_split_sizes, algorithm, group)
        return grad_in, None, None, None, None


def all_to_all_single_autograd(
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    algorithm: str = AUTO,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The all-to-all as a differentiable function (torch's functional-collectives name): returns
    a new tensor; its gradient is the all-to-all of the output's gradient with the splits swapped.
    """
    outs = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    ins = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    return _AllToAll.apply(input, outs, ins, algorithm, group)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


__all__ = ["AUTO", "all_to_all_single", "all_to_all_single_autograd", "choose", "cost_s"]
