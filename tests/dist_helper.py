"""The one multi-process helper of the test suite: a gloo world of N CPU ranks with a hard timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringtree.launch import spawn


def run_world(
    fn: Callable[..., Any], nproc: int, *args: Any, timeout: float = 120.0, local: int | None = None
) -> list[Any]:
    """fn(rank, *args) on nproc ranks; each rank's return value, or the first rank's exception."""
    return spawn(fn, nproc, args, timeout_s=timeout, local_world_size=local, collective_timeout_s=30.0)
