"""The public collectives: all_reduce, reduce_scatter, all_gather, broadcast, reduce
(all_to_all_single: `ringtree.comm.alltoall`).

Each takes `algorithm=` (one of `algorithms(collective)`: "native" is torch.distributed's own,
every other name is a ringtree schedule run by the executor) and works in place like torch's.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree import schedules
from ringtree.comm import annotate, flight_recorder
from ringtree.comm.errors import CollectiveError, MismatchError
from ringtree.comm.executor import execute
from ringtree.comm.reduce_ops import COMBINE, DTYPES, OPS, TORCH_OP, check_op
from ringtree.topology import Topology

DEFAULT_TIMEOUT_S = 60.0
NATIVE = "native"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


def algorithms(collective: str = "all_reduce") -> list[str]:
    """Every algorithm name `collective` accepts, "native" first."""
    return [NATIVE, *schedules.algorithms(collective)]


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    topology: Topology | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce `tensor` across the group in place; every rank ends with the result. Returns it.

    validate=True first checks, with one small all-gather, that every rank passed the same
    element count, dtype, op and algorithm, and raises MismatchError on every rank if not.
    """
    call = _Call("all_reduce", algorithm, tensor, op, group, topology, timeout_s)
    with call:
        if validate:
            call.handshake()
        with _contiguous(tensor) as flat:
            if algorithm == NATIVE:
                call.wait_native(dist.all_reduce(flat, op=TORCH_OP[op], group=group, async_op=True), "native")
            else:
                call.run(flat)
                call.finish_avg(flat)
        return tensor


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce `input` (p times output's size) across ranks; rank i gets reduced block i in `output`."""
    call = _Call("reduce_scatter", algorithm, input, op, group, None, timeout_s)
    _check_blocks(call, output, input)
    with call:
        if validate:
            call.handshake()
        if algorithm == NATIVE:
            with _contiguous(output) as out:
                scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                work = scatter(out, input.contiguous(), op=TORCH_OP[op], group=group, async_op=True)
                call.wait_native(work, "native")
            return output
        work = input.contiguous().view(-1).clone()
        call.run(work)
        n = output.numel()
        block = work[call.rank * n : (call.rank + 1) * n]
        call.finish_avg(block)
        output.copy_(block.view_as(output))
        return output


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
) -> torch.Tensor:
    """Concatenate every rank's `input` into `output` (p times input's size), in rank order."""
    call = _Call("all_gather", algorithm, output, "sum", group, None, timeout_s)
    _check_blocks(call, input, output)
    with call:
        if validate:
            call.handshake()
        with _contiguous(output) as flat:
            n = input.numel()
            if algorithm == NATIVE:
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                call.wait_native(
                    gather(flat, input.contiguous().view(-1), group=group, async_op=True), "native"
                )
            else:
                flat[call.rank * n : (call.rank + 1) * n].copy_(input.reshape(-1))
                call.run(flat)
        return output


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    algorithm: str = "tree",
    group: dist.ProcessGroup | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
) -> torch.Tensor:
    """Copy `tensor` from global rank `src` to every rank of the group, in place."""
    call = _Call("broadcast", algorithm, tensor, "sum", group, None, timeout_s, root=src)
    with call:
        if validate:
            call.handshake()
        with _contiguous(tensor) as flat:
            if algorithm == NATIVE:
                call.wait_native(dist.broadcast(flat, src, group=group, async_op=True), "native")
            else:
                call.run(flat)
        return tensor


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: str = "sum",
    algorithm: str = "tree",
    group: dist.ProcessGroup | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce `tensor` onto global rank `dst` in place; other ranks' tensors hold partial data."""
    call = _Call("reduce", algorithm, tensor, op, group, None, timeout_s, root=dst)
    with call:
        if validate:
            call.handshake()
        with _contiguous(tensor) as flat:
            if algorithm == NATIVE:
                call.wait_native(
                    dist.reduce(flat, dst, op=TORCH_OP[op], group=group, async_op=True), "native"
                )
            else:
                call.run(flat)
                if call.rank == call.root:
                    call.finish_avg(flat)
        return tensor


class _Call:
    """One collective call's validated arguments, and how to run its schedule."""

    def __init__(
        self,
        collective: str,
        algorithm: str,
        tensor: torch.Tensor,
        op: str,
        group: dist.ProcessGroup | None,
        topology: Topology | None,
        timeout_s: float,
        root: int | None = None,
        valid: list[str] | None = None,
    ) -> None:
        valid = algorithms(collective) if valid is None else valid
        if algorithm not in valid:
            names = ", ".join(valid)
            raise ValueError(f"unknown {collective} algorithm {algorithm!r}; choose one of {names}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{collective} needs a torch.Tensor, got {type(tensor).__name__}")
        check_op(op, tensor.dtype)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not dist.is_initialized():
            raise RuntimeError(
                f"{collective} needs a process group: call torch.distributed.init_process_group "
                "(or run under torchrun / ringtree's --nproc) first"
            )
        self.collective, self.algorithm, self.op, self.group = collective, algorithm, op, group
        self.tensor = tensor
        self.timeout = timedelta(seconds=timeout_s)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.peers = [_global_rank(group, r) for r in range(self.world_size)]
        if root is not None and root not in self.peers:
            raise ValueError(f"{collective}: root rank {root} is not in the group {self.peers}")
        self.root = 0 if root is None else self.peers.index(root)  # as a group rank
        self.topology = topology or _default_topology(group, self.world_size)
        if self.topology.world_size != self.world_size:
            raise ValueError(
                f"topology has {self.topology.world_size} ranks but the group has {self.world_size}"
            )

    def __enter__(self) -> _Call:
        """Record the call in the flight recorder (its sequence number joins the handshake)."""
        self.record = flight_recorder.RECORDER.begin(
            self.collective,
            self.algorithm,
            self.tensor.numel(),
            str(self.tensor.dtype).removeprefix("torch."),
            self.peers,
        )
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        """A failed or timed-out collective names its culprit from every rank's record."""
        if error is None:
            flight_recorder.RECORDER.end(self.record, "completed")
        elif isinstance(error, CollectiveError):
            why = flight_recorder.diagnose(self.record, dist.get_rank())
            raise CollectiveError(f"{error} {why}", peer=error.peer) from error
        else:
            flight_recorder.RECORDER.end(self.record, "failed")

    def run(self, flat: torch.Tensor) -> None:
        if self.world_size == 1 or flat.numel() == 0:
            return
        request = schedules.Request(
            self.collective,
            self.algorithm,
            self.topology,
            flat.numel(),
            flat.element_size(),
            self.root,
        )
        schedule = schedules.build(request)
        what = f"ringtree {self.collective}(algorithm={self.algorithm!r}, count={flat.numel()})"
        # the profiler span records the collective's input: an all-gather's one block of the output
        shown = flat[: flat.numel() // self.world_size] if self.collective == "all_gather" else flat
        with annotate.span(f"ringtree:{self.collective}", shown):
            execute(
                flat,
                schedule,
                self.rank,
                COMBINE[self.op],
                peers=self.peers,
                group=self.group,
                timeout=self.timeout,
                what=what,
            )

    def wait_native(self, work: dist.Work | None, stage: str) -> None:
        """Wait for a torch.distributed work with this call's timeout, raising CollectiveError."""
        if work is None:
            return
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise CollectiveError(
                f"ringtree {self.collective}(algorithm={self.algorithm!r}) {stage} on rank "
                f"{dist.get_rank()} failed or timed out after {self.timeout.total_seconds():g}s: "
                f"{str(e).splitlines()[0][:300]}. A peer probably died or is not calling "
                f"{self.collective}; check the other ranks' logs."
            ) from e

    def finish_avg(self, flat: torch.Tensor) -> None:
        if self.op == "avg":
            flat.div_(self.world_size)

    def handshake(self) -> None:
        """All-gather (collective, sequence number, count, dtype, op, algorithm, root) and raise
        on every rank if they differ: a rank that skipped or reordered a collective is named here."""
        if self.world_size == 1:
            return
        fields = {
            "collective": COLLECTIVES.index(self.collective),
            "sequence number": self.record.seq,
            "element count": self.tensor.numel(),
            "dtype": DTYPES.index(self.tensor.dtype),
            "op": OPS.index(self.op),
            "algorithm": algorithms(self.collective).index(self.algorithm),
            "root": self.root,
        }
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=self.tensor.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.wait_native(dist.all_gather(every, mine, group=self.group, async_op=True), "handshake")
        table = torch.stack(every).cpu().tolist()
        for j, name in enumerate(fields):
            values = [row[j] for row in table]
            if len(set(values)) > 1:
                raise MismatchError(self._mismatch(name, values))

    def _mismatch(self, name: str, values: list[int], valid: list[str] | None = None) -> str:
        names: dict[str, list[str]] = {
            "collective": list(COLLECTIVES),
            "dtype": [str(d).removeprefix("torch.") for d in DTYPES],
            "op": list(OPS),
            "algorithm": algorithms(self.collective) if valid is None else valid,
        }

        def decode(v: int) -> str:
            return names[name][v] if name in names else str(v)

        per_rank = ", ".join(f"rank {self.peers[r]}: {decode(v)}" for r, v in enumerate(values))
        usual = max(set(values), key=values.count)
        odd = ", ".join(str(self.peers[r]) for r, v in enumerate(values) if v != usual)
        rule = (
            "every rank must call the same collectives in the same order"
            if name in ("collective", "sequence number")
            else "every rank must pass a tensor of the same size and dtype and the same op and algorithm"
            if name != "row size"
            else "every rank must pass blocks of the same row shape (all but dim 0)"
        )
        return (
            f"{self.collective} called with different {name} on different ranks ({per_rank}); "
            f"{rule} (rank {odd} differs from the others)"
        )


def _check_blocks(call: _Call, block: torch.Tensor, full: torch.Tensor) -> None:
    if full.numel() != block.numel() * call.world_size:
        raise ValueError(
            f"{call.collective}: the full tensor has {full.numel()} elements but must have "
            f"world_size x block = {call.world_size} x {block.numel()} = "
            f"{call.world_size * block.numel()}"
        )
    if block.dtype != full.dtype:
        raise TypeError(f"{call.collective}: input and output dtypes differ ({block.dtype} vs {full.dtype})")


class _contiguous:
    """A flat contiguous view of a tensor; a non-contiguous one is copied and written back."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)

    def __enter__(self) -> torch.Tensor:
        return self.flat

    def __exit__(self, *exc: object) -> None:
        if not self.tensor.is_contiguous() and exc[0] is None:
            self.tensor.copy_(self.flat.view_as(self.tensor))


def _global_rank(group: dist.ProcessGroup | None, r: int) -> int:
    if group is None or group is dist.group.WORLD:
        return r
    return dist.get_global_rank(group, r)


def _default_topology(group: dist.ProcessGroup | None, world_size: int) -> Topology:
    """The world's node structure from torchrun's LOCAL_WORLD_SIZE; a subgroup counts as one node."""
    if group is None or group is dist.group.WORLD:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local > 0 and world_size % local == 0:
            return Topology(world_size, local)
    return Topology.single_node(world_size)
