"""A dataset factory for the kill-and-resume test: the digits, with rank 1 killed (SIGKILL) in the
middle of its first attempt once RINGTREE_TEST_KILL_AFTER samples were read."""

from __future__ import annotations

import os
import signal
from typing import Any

from torch.utils.data import Dataset

from ringtree.launch import restart_count
from ringtree.train.data import digits

KILL_AFTER = "RINGTREE_TEST_KILL_AFTER"


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
    return DiesOnce(train, int(os.environ.get(KILL_AFTER, "0"))), test
