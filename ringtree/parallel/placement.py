"""Where the ranks of one host run: spread evenly over its cores when they outnumber them.

When a host's ranks outnumber its cores, the kernel may run one rank alone on a core while three
share the other (4 ranks on 2 cores): that rank races ahead and every collective waits for the
others. Pinning local rank i to core i mod n keeps the same number of ranks on every core (as MPI
launchers bind ranks to cores). Measured on 4 ranks over 2 cores (docs/results/benchmarks.md): the spread
of the ranks' backward ends, 90th percentile, 20-22 -> 5.5 ms; exposed communication 5 -> 3.5 ms;
step 36 -> 35 ms.

Only where the choice is clearly right: the process may use every core (an affinity the user set
is left alone), and the host's ranks are a multiple of its cores (3 ranks on 2 cores would put two
on one core). The pin is undone when its owner closes. `RINGTREE_PIN_RANKS=0` turns it off (a host
shared with other work, or a rank that wants its intra-op threads on every core).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

PIN_ENV = "RINGTREE_PIN_RANKS"  # 1 (the default): spread the ranks where `core_for` says; 0: never


def enabled() -> bool:
    """Whether ranks may be pinned: PIN_ENV's value, 1 (the default) or 0; anything else refused."""
    setting = os.environ.get(PIN_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(
            f"{PIN_ENV}={setting!r} is not 0 or 1; set it to 0 to never pin ranks to cores, or unset it"
        )
    return setting == "1"


def core_for(local_rank: int, local_world_size: int, allowed: set[int], cpus: int) -> int | None:
    """The core local rank `local_rank` should run on, or None to leave the placement alone."""
    if len(allowed) != cpus or local_world_size < cpus or local_world_size % cpus:
        return None
    return sorted(allowed)[local_rank % cpus]


def spread() -> Callable[[], None] | None:
    """Pin every thread of this process to its core (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE)
    where `core_for` says so; return what undoes it, or None where nothing was changed."""
    if "LOCAL_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ or not enabled():
        return None
    allowed = os.sched_getaffinity(0)
    local = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    core = core_for(*local, allowed, os.cpu_count() or 1)
    if core is None:
        return None
    _pin_threads({core})
    return lambda: _pin_threads(allowed)


def _pin_threads(cpus: set[int]) -> None:
    """Set the affinity of every thread of this process (threads started later inherit it from
    the thread that starts them)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)
