"""Ctrl-C during a run: rank 0's step, shared with the launching process through a mapped file.

The launcher makes an 8-byte file in a temporary folder and names it in RINGTREE_STEP_BOARD,
which its workers inherit; rank 0 writes its step there after every optimizer step (a store
into shared memory, no system call), so an interrupted launcher can say where the run stopped
(`interrupted at step S; last checkpoint: ...`) even when the workers were killed mid-step.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "RINGTREE_STEP_BOARD"
_SLOT = struct.Struct("<q")  # one signed 64-bit step


class StepBoard:
    """An 8-byte file mapped into memory: the step rank 0 has finished."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SLOT.size)

    def write(self, step: int) -> None:
        _SLOT.pack_into(self._map, 0, step)

    def read(self) -> int:
        return int(_SLOT.unpack_from(self._map, 0)[0])

    def close(self) -> None:
        self._map.close()


@contextmanager
def shared_step() -> Iterator[StepBoard]:
    """A board for the workers started inside the block (they inherit RINGTREE_STEP_BOARD)."""
    previous = os.environ.get(ENV)
    with tempfile.TemporaryDirectory(prefix="ringtree-step-") as tmp:
        path = Path(tmp) / "step"
        path.write_bytes(bytes(_SLOT.size))
        board = StepBoard(path)
        os.environ[ENV] = str(path)
        try:
            yield board
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
            board.close()


def publisher() -> StepBoard | None:
    """The board a launcher made for this worker, or None (under torchrun, or from Python)."""
    path = os.environ.get(ENV)
    return StepBoard(path) if path and Path(path).is_file() else None
