"""A dataset factory for the kill-and-resume test: the digits, with rank 1 killed (SIGKILL) in the
middle of its first attempt once RINGTREE_TEST_KILL_AFTER samples were read, or as it writes its
RINGTREE_TEST_KILL_IN_SAVE-th sharded checkpoint; and a small model with its own TP plan."""

from __future__ import annotations

import os
import signal
from typing import Any, ClassVar

from torch import nn
from torch.utils.data import Dataset

from ringtree.processes import restart_count
from ringtree.train.data import digits

KILL_AFTER = "RINGTREE_TEST_KILL_AFTER"
KILL_IN_SAVE = "RINGTREE_TEST_KILL_IN_SAVE"


class DiesOnce(Dataset[Any]):
    """Reads through to `data`; on rank 1's first attempt, the process dies after `after` reads."""

    def __init__(self, data: Any, after: int) -> None:
        self.data, self.after, self.reads = data, after, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        if self.after and self.reads > self.after and os.environ.get("RANK") == "1" and not restart_count():
            os.kill(os.getpid(), signal.SIGKILL)  # as a preemption or the OOM killer would
        return self.data[i]


def digits_that_die() -> tuple[Dataset[Any], Dataset[Any]]:
    train, test = digits()
    if os.environ.get(KILL_IN_SAVE):
        _die_in_save(int(os.environ[KILL_IN_SAVE]))
    return DiesOnce(train, int(os.environ.get(KILL_AFTER, "0"))), test


def sort_that_dies() -> tuple[Dataset[Any], Dataset[Any]]:
    """The MoE tests' slice of the sort task (256 sequences), rank 1 dying as digits_that_die's."""
    from torch.utils.data import Subset

    from ringtree.train.language import sort_datasets

    train, test = sort_datasets()
    return DiesOnce(Subset(train, range(256)), int(os.environ.get(KILL_AFTER, "0"))), Subset(test, range(64))


def _die_in_save(n: int) -> None:
    """Rank 1 SIGKILLs itself in its first attempt's n-th sharded save, its shard half written."""
    from ringtree.train import sharded_checkpoint

    save, calls = sharded_checkpoint.dcp_save, [0]

    def dies(state: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == n and os.environ.get("RANK") == "1" and not restart_count():
            path = kw["checkpoint_id"]
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "__1_0.distcp"), "wb") as f:
                f.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return save(state, **kw)

    sharded_checkpoint.dcp_save = dies  # type: ignore[assignment]


class TinyTP(nn.Sequential):
    """A user's model for the digits with its own TP plan: 64 -> 32 (column) -> 32 (row) -> 10."""

    tp_plan: ClassVar[dict[str, str]] = {"0": "colwise", "2": "rowwise"}


def tiny_tp() -> nn.Module:
    return TinyTP(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
