"""What a schedule makes one rank send to ranks on other nodes (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from ringtree.schedules.base import OpKind, Schedule


def bytes_sent_off_node(schedule: Schedule, rank: int, node_of: Sequence[int], itemsize: int) -> int:
    """Bytes `rank` (a rank of the schedule) sends to peers whose node differs from its own.

    node_of[r]: the node of the schedule's rank r (its group rank). All-to-all schedules address
    a block matrix, and their ops' element ranges count the same way.
    """
    mine = node_of[rank]
    return itemsize * sum(
        op.numel
        for step in schedule.for_rank(rank)
        for op in step
        if op.kind is OpKind.SEND and node_of[op.peer] != mine
    )
