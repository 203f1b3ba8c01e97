"""Interval arithmetic on numpy arrays: unions and their lengths (integer nanoseconds).

Every overlap figure is inclusion-exclusion over unions: |A and B| = |A| + |B| - |A or B|.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.int64]
Union = tuple[Array, Array]  # disjoint intervals [start, end), sorted


def union(start: Array, end: Array) -> Union:
    """The disjoint, sorted intervals covering every [start_i, end_i) (touching ones merge)."""
    if start.size == 0:
        return start.copy(), end.copy()
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    begins = np.concatenate(([True], s[1:] > reach[:-1]))  # beyond everything before it
    index = np.flatnonzero(begins)
    return s[index], np.maximum.reduceat(e, index)


def measure(u: Union) -> int:
    """The length of a union."""
    return int((u[1] - u[0]).sum())


def join(*unions: Union) -> Union:
    """The union of unions."""
    return union(np.concatenate([u[0] for u in unions]), np.concatenate([u[1] for u in unions]))


def overlap(a: Union, b: Union) -> int:
    """|a and b|, the time both are busy."""
    return measure(a) + measure(b) - measure(join(a, b))


def gaps(u: Union) -> Union:
    """The holes between a union's intervals (none before the first or after the last)."""
    return u[1][:-1], u[0][1:]


def difference(a: Union, b: Union) -> Union:
    """The parts of a outside b."""
    times = np.concatenate([a[0], a[1], b[0], b[1]])
    da = np.concatenate([np.ones_like(a[0]), -np.ones_like(a[1]), np.zeros_like(b[0]), np.zeros_like(b[1])])
    db = np.concatenate([np.zeros_like(a[0]), np.zeros_like(a[1]), np.ones_like(b[0]), -np.ones_like(b[1])])
    order = np.argsort(times, kind="stable")
    t, in_a, in_b = times[order], np.cumsum(da[order]), np.cumsum(db[order])
    keep = (in_a[:-1] > 0) & (in_b[:-1] == 0) & (t[1:] > t[:-1])  # state after each boundary
    return union(t[:-1][keep], t[1:][keep])
