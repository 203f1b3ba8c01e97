"""Profiler spans for ringtree's own collectives: `ringtree:all_reduce` and the like, recorded
with the buffer as input (its shape and dtype, as gloo's `gloo:*` spans carry theirs), so that a
torch.profiler trace of a run shows them and `ringtree trace` sizes them. Nothing is recorded,
and nearly nothing spent, while no profiler runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._C._autograd import _record_function_with_args_enter, _record_function_with_args_exit


@contextmanager
def span(name: str, tensor: torch.Tensor) -> Iterator[None]:
    """A profiler span `name` with `tensor` as its recorded input, while a profiler is on."""
    # torch.profiler's own flag: `_profiler_enabled()` is per thread, and False on every thread
    # while `profile_all_threads` profiles them all
    if not torch.autograd.profiler._is_profiler_enabled:
        yield
        return
    handle = _record_function_with_args_enter(name, tensor)
    try:
        yield
    finally:
        _record_function_with_args_exit(handle)
