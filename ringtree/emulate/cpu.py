"""Equal, fixed CPU shares for the emulated nodes: one cpu cgroup per node with a CFS quota.

The emulated nodes share the host's cores. Left to the scheduler, one node runs ahead of another
by a few percent over a second, which real machines do not do to each other; a method that
synchronises every H steps then waits at each sync for the node that fell behind. With
`--cpus-per-node C` every node's processes (its torchrun agent and ranks) run in a cgroup of
their own, capped at C cores (a quota of C x PERIOD_US per PERIOD_US), so that each node gets
the same CPU time each period whether or not another node is waiting. The groups are named after
the network's tag and removed with it; `cleanup` removes those an interrupted run left.

Uses the cgroup v1 cpu controller (/sys/fs/cgroup/cpu) or cgroup v2 (cpu.max), whichever the
host mounts; `unavailable()` says why neither can be used.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ringtree.emulate import interrupt

PREFIX = "rtemu"  # every group this module creates starts with it (as the network's names do)
PERIOD_US = 10_000  # a short period: a node that used its quota waits at most (1 - C) x 10 ms
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


def parse(text: str, nodes: int, cores: int | None = None) -> float | None:
    """`--cpus-per-node` -> cores per node: 'shared' (None, the scheduler's), 'auto' (the cores
    this process may run on, over the nodes) or a number; more than those in all is refused."""
    cores = cores or len(os.sched_getaffinity(0)) or 1
    word = text.strip().lower()
    if word == "shared":
        return None
    if word == "auto":
        return int(cores / nodes * 1000) / 1000  # rounded down: the shares never add up to more
    try:
        share = float(word)
    except ValueError:
        raise ValueError(
            f"cannot read --cpus-per-node {text!r}; give cores per node (e.g. 0.5), auto or shared"
        ) from None
    if share < 0.01:
        raise ValueError(f"--cpus-per-node must be at least 0.01 cores, got {text}")
    if share * nodes > cores + 1e-9:
        raise ValueError(
            f"--cpus-per-node {text} on {nodes} nodes asks for {share * nodes:g} cores, but this machine "
            f"has {cores}; give at most {int(cores / nodes * 1000) / 1000:g} (or auto)"
        )
    return share


def root() -> tuple[Path, int] | None:
    """The cpu controller's hierarchy and its cgroup version, if the host mounts one."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists() or (V1_ROOT / "cgroup.procs").exists():
        return V1_ROOT, 1
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2_ROOT, 2
    return None


def unavailable() -> str | None:
    """Why per-node CPU shares cannot be made here (None: they can)."""
    found = root()
    if found is None:
        return "this host mounts no cgroup cpu controller (neither /sys/fs/cgroup/cpu nor cgroup v2's cpu)"
    if not os.access(found[0], os.W_OK):
        return f"{found[0]} is not writable; run as root"
    return None


@dataclass
class Shares:
    """The built groups, one per node; `close()` (or leaving the `with`) removes them."""

    cores: float
    groups: list[Path]
    version: int

    def __enter__(self) -> Shares:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wrap(self, i: int, command: Sequence[str]) -> list[str]:
        """`command` run inside node i's group: the shell joins the group, then becomes it."""
        procs = self.groups[i] / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]

    def close(self) -> None:
        with interrupt.deferred():
            for group in self.groups:
                remove(group)
            self.groups = []


def describe(cores: float) -> str:
    """What the shares are, in words (the cluster record's cpu_policy)."""
    quota = max(1000, round(cores * PERIOD_US))
    return f"every node capped at {cores:g} cores (a cpu cgroup quota of {quota} us per {PERIOD_US} us)"


def build(tag: str, nodes: int, cores: float) -> Shares:
    """One group per node, `{tag}-cpu{i}`, each capped at `cores` cores."""
    found = root()
    if found is None or unavailable():
        raise RuntimeError(f"cannot give the nodes CPU shares: {unavailable()}")
    base, version = found
    if version == 2:
        _enable_v2(base)
    shares = Shares(cores, [], version)
    quota = max(1000, round(cores * PERIOD_US))  # the kernel's least quota is 1 ms
    try:
        for i in range(nodes):
            group = base / f"{tag}-cpu{i}"
            group.mkdir()
            shares.groups.append(group)
            if version == 1:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except BaseException:
        shares.close()
        raise
    return shares


@contextlib.contextmanager
def maybe(tag: str, nodes: int, cores: float | None) -> Iterator[Shares | None]:
    """`build`'s groups for the run, or None when the nodes share the cores freely."""
    if cores is None:
        yield None
        return
    with build(tag, nodes, cores) as shares:
        yield shares


def remove(group: Path, tries: int = 25) -> None:
    """Delete a group; what still runs in it (an interrupted run's leftover) goes to the parent."""
    for _ in range(tries):
        if not group.exists():
            return
        try:
            group.rmdir()
            return
        except OSError:  # busy: processes killed a moment ago, or still running
            for pid in _pids(group):
                with contextlib.suppress(OSError):
                    (group.parent / "cgroup.procs").write_text(pid)
            time.sleep(0.2)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every group an emulate run left behind; their names."""
    found = root()
    if found is None:
        return []
    left = sorted(p for p in found[0].iterdir() if p.is_dir() and p.name.startswith(prefix))
    for group in left:
        remove(group)
    return [p.name for p in left]


def listed(prefix: str = PREFIX) -> list[str]:
    """Groups whose names start with prefix (there should be none outside a run)."""
    found = root()
    if found is None:
        return []
    return sorted(p.name for p in found[0].iterdir() if p.is_dir() and p.name.startswith(prefix))


def _pids(group: Path) -> list[str]:
    try:
        return (group / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _enable_v2(base: Path) -> None:
    control = base / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")
