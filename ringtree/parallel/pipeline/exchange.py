"""Stage-to-stage transfers of a pipeline run: receives posted early, sends asynchronous, no handshakes.

Indices: i micro-batch, j stage. Every message is a fixed-size header (shape and dtype, or ABORT)
followed by the data. gloo's point-to-point is a rendezvous: a send leaves only once the receiver
has posted its receive, so a receive posted when the data is needed costs a round trip between
the two processes' transport threads per message (twice: header, then data). Here, at the start
of a run, a stage posts the receive of every header it will get, in the order its schedule
receives them, and the receive of every payload whose shape it already knows: a gradient has the
shape of the activation it belongs to (posted right after that forward), and an activation has
the shape it had for the same micro-batch in the previous run. When the sender sees that the shape
changed (a short last batch), it fills the receive posted for the old shape and sends the payload
again on a separate tag that the receiver posts once it has read the header. Both ends keep the
same record of the shapes transferred, so neither ever waits for the other's permission to send.

NCCL ignores tags and runs a pair's transfers in one stream, so receives posted ahead of sends
could block them: with NCCL every receive is posted when it is needed, header first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree.comm.errors import CollectiveError

HEADER = 8  # int64 slots: ndim (or ABORT), up to 6 sizes, dtype code
ABORT = -1
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ABORT_WAIT_S = 2.0  # how long a failing stage waits for its abort messages to leave
# Tags: one FIFO of headers per direction (so an abort matches whichever header is next), then
# per micro-batch one tag for the payload posted early and one for a payload posted late.
TAG_BASE = 7000
HEADER_TAG = {"activation": TAG_BASE, "gradient": TAG_BASE + 1}
DIRECTIONS = ("activation", "gradient")
Shape = tuple[tuple[int, ...], torch.dtype]


class Aborted(Exception):
    """A neighbouring stage sent an abort header: stage `failed` failed; it came from stage `came_from`."""

    def __init__(self, message: str, failed: int, came_from: int) -> None:
        super().__init__(message)
        self.failed, self.came_from = failed, came_from


def _data_tag(what: str, i: int, late: bool) -> int:
    return TAG_BASE + 2 + 4 * i + 2 * DIRECTIONS.index(what) + int(late)


def _header(shape: Shape, device: torch.device) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64)
    dims, dtype = shape
    header[0], header[-1] = len(dims), DTYPES.index(dtype)
    header[1 : 1 + len(dims)] = torch.tensor(dims)
    return header.to(device)


def _shape_of(header: list[int]) -> Shape:
    return tuple(header[1 : 1 + header[0]]), DTYPES[header[-1]]


@dataclass
class _Posted:
    """Receives posted for one direction of one run: headers in schedule order, payloads by i."""

    headers: deque[tuple[dist.Work, torch.Tensor]] = field(default_factory=deque)
    early: dict[int, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)


class Exchange:
    """This stage's transfers with stages j-1 and j+1; the shape records outlive a run."""

    def __init__(self, stage: int, ranks: list[int], device: torch.device, timeout_s: float) -> None:
        self.stage, self.ranks, self.device, self.timeout_s = stage, ranks, device, timeout_s
        self.early = True  # set by start(), once the process group exists (see the module's docstring)
        # (direction, i) -> the shape last transferred; sender and receiver keep identical copies
        self.sent: dict[tuple[str, int], Shape] = {}
        self.received: dict[tuple[str, int], Shape] = {}
        self.posted = {what: _Posted() for what in DIRECTIONS}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.context = ""  # the schedule's name, for error messages

    def peer(self, what: str, sending: bool) -> int:
        """Stage j's partner for a transfer of `what` (activations flow to j+1, gradients to j-1)."""
        up = (what == "activation") == sending
        return self.stage + (1 if up else -1)

    def start(self, receives: list[tuple[str, int]], context: str) -> None:
        """Post the headers of the run's receives (in order) and the payloads of known shape."""
        self.context = context
        self.early = dist.get_backend() != "nccl"
        self.posted = {what: _Posted() for what in DIRECTIONS}
        if not self.early:
            return
        for what, i in receives:
            header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
            self.posted[what].headers.append((self._irecv(header, what, HEADER_TAG[what]), header))
            if what == "activation" and (what, i) in self.received:
                self.expect(what, i, self.received[(what, i)])

    def expect(self, what: str, i: int, shape: Shape) -> None:
        """Post the receive of micro-batch i's payload, whose shape is known, if posting early."""
        self.received[(what, i)] = shape
        if self.early:
            buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
            self.posted[what].early[i] = (self._irecv(buf, what, _data_tag(what, i, False)), buf)

    def send(self, what: str, i: int, t: torch.Tensor) -> None:
        """Send micro-batch i's activation or gradient without waiting for it to leave."""
        t = t.detach().contiguous()
        shape: Shape = (tuple(t.shape), t.dtype)
        dst = self.ranks[self.peer(what, sending=True)]
        expected = self.sent.get((what, i)) if what == "activation" else shape
        parts: list[tuple[torch.Tensor, int]] = [(_header(shape, self.device), HEADER_TAG[what])]
        if not self.early:
            parts.append((t, 0))
        elif expected == shape:
            parts.append((t, _data_tag(what, i, False)))
        else:
            if expected is not None:  # fill the receive posted for the old shape, then resend
                filler = torch.zeros(expected[0], dtype=expected[1], device=self.device)
                parts.append((filler, _data_tag(what, i, False)))
            parts.append((t, _data_tag(what, i, True)))
        for part, tag in parts:
            work = dist.isend(part, dst, tag=tag if self.early else 0)
            assert work is not None, "isend to another rank returns a Work"
            self.sends.append((work, part))
        self.sent[(what, i)] = shape

    def recv(self, what: str, i: int) -> torch.Tensor:
        """Micro-batch i's activation (from j-1) or gradient (from j+1); raises Aborted on an abort."""
        posted = self.posted[what]
        if posted.headers:
            work, header = posted.headers.popleft()
        else:
            header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
            work = self._irecv(header, what, HEADER_TAG[what] if self.early else 0)
        self.wait(work, f"the header of the {what}", i)
        values = [int(v) for v in header.tolist()]
        if values[0] == ABORT:
            self._aborted(values[1], self.peer(what, sending=False))
        shape = _shape_of(values)
        early = posted.early.pop(i, None)
        if early is not None:
            self.wait(early[0], f"the {what}", i)
            if (tuple(early[1].shape), early[1].dtype) == shape:
                self.received[(what, i)] = shape
                return early[1]
        buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
        self.wait(self._irecv(buf, what, _data_tag(what, i, True) if self.early else 0), f"the {what}", i)
        self.received[(what, i)] = shape
        return buf

    def finish(self) -> None:
        """Wait until every send of the run has left."""
        for work, _ in self.sends:
            self.wait(work, "a send", -1)
        self.sends.clear()

    def _irecv(self, buf: torch.Tensor, what: str, tag: int) -> dist.Work:
        work = dist.irecv(buf, self.ranks[self.peer(what, sending=False)], tag=tag)
        assert work is not None, "irecv from another rank returns a Work"
        return work

    def _aborted(self, failed: int, came_from: int) -> None:
        raise Aborted(
            f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) stops: stage "
            f"{failed} (rank {self.ranks[failed]}) failed; see that rank's error",
            failed,
            came_from,
        )

    def wait(self, work: dist.Work, what: str, i: int) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CollectiveError(
                f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) could not complete "
                f"{what} of micro-batch {i} within {self.timeout_s:.0f}s ({self.context} schedule): a "
                f"neighbouring stage failed or is stuck ({e})"
            ) from None

    def abort(self, failed: int, came_from: int | None) -> None:
        """Tell the neighbouring stages (but the one the abort came from) that stage `failed` failed."""
        works = []
        for what in DIRECTIONS:
            peer = self.peer(what, sending=True)
            if 0 <= peer < len(self.ranks) and peer != came_from:
                header = torch.zeros(HEADER, dtype=torch.int64)
                header[0], header[1] = ABORT, failed
                tag = HEADER_TAG[what] if self.early else 0
                works.append(dist.isend(header.to(self.device), self.ranks[peer], tag=tag))
        for work in works:
            try:
                if work is not None:
                    work.wait(timeout=timedelta(seconds=ABORT_WAIT_S))
            except RuntimeError:
                pass  # the neighbour is gone or stuck itself; its own timeout covers it
