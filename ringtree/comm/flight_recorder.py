"""Each rank's recent collectives, published so that a hang can name its culprit.

Like torch's Flight Recorder for NCCL, every rank keeps a small ring buffer of the collectives it
called (operation, algorithm, element count, sequence number, group, state). The sequence number
counts ringtree collectives per group, so it is equal on every rank that follows the program.

Each call also publishes its (sequence number, operation) under one key per rank in the process
group's own store (torch's TCPStore or FileStore: no socket of ours), which costs one small store
write per collective. When a collective fails or times out, every surviving rank dumps its
buffer to a JSON file and reads its peers' keys: the first rank whose sequence number lags, whose
operation differs, or that never published is the culprit the error names.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # exported, not in __all__

CAPACITY = 64  # collectives kept per rank: enough to see the last few training steps
KEY_PREFIX = "ringtree/flight"
DUMP_DIR_ENV = "RINGTREE_FLIGHT_RECORDER_DIR"  # where dumps go (default: the temp folder)


@dataclass
class Record:
    """One collective as this rank called it."""

    seq: int  # 1, 2, ... per group, in call order
    collective: str
    algorithm: str
    count: int  # elements
    dtype: str
    group: list[int]  # global ranks of the group
    state: str = "started"  # started, completed, failed
    started_s: float = 0.0  # time.time() when called
    ended_s: float | None = None


@dataclass(frozen=True)
class Published:
    """What a peer published about its latest collective on a group."""

    rank: int
    seq: int
    collective: str
    algorithm: str


class FlightRecorder:
    """The ring buffer of one process; thread-safe (DDP reduces from a helper thread)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.records: deque[Record] = deque(maxlen=capacity)
        self._seq: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()

    def begin(self, collective: str, algorithm: str, count: int, dtype: str, group: list[int]) -> Record:
        """Record (and publish) a collective this rank is about to run."""
        key = tuple(group)
        with self._lock:
            seq = self._seq.get(key, 0) + 1
            self._seq[key] = seq
            record = Record(seq, collective, algorithm, count, dtype, list(group), started_s=time.time())
            self.records.append(record)
        _publish(record)
        return record

    def end(self, record: Record, state: str) -> None:
        record.state, record.ended_s = state, time.time()

    def dump(self, rank: int) -> Path:
        """Write this rank's records as JSON; return the file's path."""
        folder = Path(os.environ.get(DUMP_DIR_ENV) or Path(tempfile.gettempdir()) / _run_folder())
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        with self._lock:
            records = [asdict(r) for r in self.records]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"rank": rank, "records": records}, indent=1) + "\n")
        tmp.replace(path)
        return path

    def reset(self) -> None:
        """Forget everything (a new process group starts counting from 1)."""
        with self._lock:
            self.records.clear()
            self._seq.clear()


RECORDER = FlightRecorder()


def culprit(record: Record, me: int, peers: list[Published | None], wait_s: float = 0.0) -> str | None:
    """One sentence naming the first rank that is not where `record` (this rank's) is, or None.

    `peers[i]` is what group rank i published (None: nothing). A peer behind this rank's sequence
    number skipped or has not reached this collective; a peer at the same number with another
    operation called something else; a peer that never published never joined this group's
    collectives (dead, or never started).
    """
    for i, peer in enumerate(peers):
        rank = record.group[i]
        if rank == me:
            continue
        if peer is None:
            return f"rank {rank} never called a collective on this group (dead, or not started)"
        if peer.seq < record.seq:
            return (
                f"rank {rank} lags: its latest collective is #{peer.seq} ({peer.collective}, "
                f"{peer.algorithm}) while rank {me} waits in #{record.seq} ({record.collective}); "
                f"rank {rank} skipped {record.collective} or is stuck before it"
            )
        if peer.seq == record.seq and peer.collective != record.collective:
            return (
                f"rank {rank} called {peer.collective} as collective #{peer.seq} where rank {me} "
                f"called {record.collective}"
            )
    ahead = [p for p in peers if p is not None and p.seq > record.seq]
    if ahead:
        return (
            f"rank {me} lags: rank {ahead[0].rank} is already at collective #{ahead[0].seq} "
            f"({ahead[0].collective}) while rank {me} is at #{record.seq} ({record.collective})"
        )
    return None


def diagnose(record: Record, me: int) -> str:
    """Dump this rank's records and name the culprit from what every peer published."""
    RECORDER.end(record, "failed")
    path = RECORDER.dump(me)
    peers = [_read(record.group, rank) for rank in record.group]
    who = culprit(record, me, peers)
    blame = f"Culprit: {who}." if who else "Every rank published the same collective; the transport failed."
    return f"{blame} Flight record of rank {me}: {path}"


def _publish(record: Record) -> None:
    store = default_store()
    if store is None:
        return
    value = f"{record.seq}|{record.collective}|{record.algorithm}"
    store.set(_key(record.group, dist.get_rank()), value)


def _read(group: list[int], rank: int) -> Published | None:
    store = default_store()
    if store is None:
        return None
    key = _key(group, rank)
    try:
        if not store.check([key]):
            return None
        seq, collective, algorithm = store.get(key).decode().split("|")
    except (RuntimeError, ValueError):  # the store's server (rank 0's agent) may be gone too
        return None
    return Published(rank, int(seq), collective, algorithm)


def _key(group: list[int], rank: int) -> str:
    return f"{KEY_PREFIX}/{'-'.join(map(str, group))}/{rank}"


def default_store() -> Store | None:
    """The default group's store. torch keeps it behind a private accessor (its own Flight
    Recorder and elastic agent use it too); if that ever moves, hangs are still reported, only
    without a culprit."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _run_folder() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getppid())
    return f"ringtree-flight-{run}"
