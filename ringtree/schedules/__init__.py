"""Collective algorithms as data: pure-Python schedule generators (no torch)."""

from ringtree.schedules.base import Op, OpKind, Schedule, Step
from ringtree.schedules.registry import COLLECTIVES, Request, algorithms, build

__all__ = ["COLLECTIVES", "Op", "OpKind", "Request", "Schedule", "Step", "algorithms", "build"]
