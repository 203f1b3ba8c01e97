"""Stage-to-stage transfers of a pipeline run: receives posted early, sends asynchronous, no handshakes.

Indices: i micro-batch, j stage. gloo's point-to-point is a rendezvous (a send leaves once the
receiver has posted its receive), and every message costs a wake-up of both processes' transport
threads, which on a loaded host is the price of a transfer. So with gloo a transfer is one message
whenever possible: a fixed-size header (shape and dtype, or ABORT) packed in front of the data in
one byte buffer, sent on a tag of its own per micro-batch and direction, into a receive posted at
the start of the run. A receive is posted early when its shape is known: a gradient has the shape
of the activation it belongs to (posted right after that forward), and an activation has the
shape it had for the same micro-batch in the previous run. Both ends keep the same record of the
shapes transferred, so the sender always knows what the receiver posted:

- posted, same shape: one packed message;
- posted, shape changed (a short last batch): a packed message of the posted size whose header
  names the new shape, then the data on a second tag that the receiver posts once it has read it;
- not posted (first run): a header on the direction's header tag (one FIFO, posted in schedule
  order at the start of the run), then the data on the second tag.

A failing stage sends its neighbours an ABORT header in whichever of these forms the neighbour's
next receive from it expects (it knows its own remaining sends and their shapes), so neither side
ever waits for the other's permission to send and a failure still reaches every stage.

NCCL ignores tags and runs a pair's transfers in one stream, so receives posted ahead of sends
could block them: with NCCL every receive is posted when it is needed, header first, then data.

Two neighbouring stages on the same rank (the V placement's turn: virtual stages p-1 and p on the
last rank) share a `Loopback`: a send there is the tensor handed over in memory, no message.
"""

from __future__ import annotations

import contextlib
import struct
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree.comm import shm
from ringtree.comm.errors import CollectiveError
from ringtree.comm.mailbox import Mailbox, mailbox

HEADER = 8  # int64 slots: ndim (or ABORT), up to 6 sizes, dtype code
HEADER_BYTES = 8 * HEADER  # in front of the data in a packed message (keeps the data 64-byte aligned)
HEADER_STRUCT = struct.Struct(f"<{HEADER}q")  # the header as a mailbox message's meta bytes
ABORT = -1
ABORT_KEY = -1  # the mailbox key of an abort message (data keys are micro-batch indices)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ABORT_WAIT_S = 2.0  # how long a failing stage waits for its abort messages to leave
# Tags: one FIFO of headers per direction, then per micro-batch one tag for the packed message
# posted early and one for a payload posted late.
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


def _header_values(shape: Shape) -> list[int]:
    dims, dtype = shape
    if len(dims) > HEADER - 2 or dtype not in DTYPES:
        raise ValueError(
            f"the pipeline sends tensors of at most {HEADER - 2} dimensions and dtype one of "
            f"{', '.join(map(str, DTYPES))}, got shape {list(dims)} and {dtype}"
        )
    return [len(dims), *dims, *[0] * (HEADER - 2 - len(dims)), DTYPES.index(dtype)]


def _header(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _abort_values(failed: int) -> list[int]:
    return [ABORT, failed, *[0] * (HEADER - 2)]


def _shape_of(header: list[int]) -> Shape:
    return tuple(header[1 : 1 + header[0]]), DTYPES[header[-1]]


def _nbytes(shape: Shape) -> int:
    dims, dtype = shape
    return HEADER_BYTES + torch.Size(dims).numel() * dtype.itemsize


def _packed(values: list[int], shape: Shape, t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """One byte buffer of the posted `shape`'s size: the header, then t (if given) as data."""
    buf = torch.empty(_nbytes(shape), dtype=torch.uint8, device=device)
    buf[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(values, dtype=torch.int64))
    if t is not None:
        _data(buf, shape).copy_(t)
    return buf


def _data(buf: torch.Tensor, shape: Shape) -> torch.Tensor:
    """The data of a packed buffer, as a tensor of `shape` (a view: no copy)."""
    return buf[HEADER_BYTES:].view(shape[1]).view(shape[0])


class Loopback(dict[tuple[str, int], torch.Tensor]):
    """Tensors handed between two stages of one rank, by (direction, micro-batch): no message."""


@dataclass
class _Posted:
    """Receives posted for one direction of one run: headers in schedule order, packed messages by i."""

    headers: deque[tuple[dist.Work, torch.Tensor]] = field(default_factory=deque)
    early: dict[int, tuple[dist.Work, torch.Tensor, Shape]] = field(default_factory=dict)


class Exchange:
    """This stage's transfers with stages j-1 and j+1; the shape records outlive a run."""

    def __init__(
        self,
        stage: int,
        ranks: list[int],
        device: torch.device,
        timeout_s: float,
        loopback: Loopback | None = None,
    ) -> None:
        self.stage, self.ranks, self.device, self.timeout_s = stage, ranks, device, timeout_s
        self.loopback = loopback  # shared with a neighbouring stage on this same rank, if any
        self.early = True  # set by start(), once the process group exists (see the module's docstring)
        # (direction, i) -> the shape last transferred; sender and receiver keep identical copies
        self.sent: dict[tuple[str, int], Shape] = {}
        self.received: dict[tuple[str, int], Shape] = {}
        self.received_now: set[tuple[str, int]] = set()  # received in this run
        self.sent_before: dict[tuple[str, int], Shape] = {}  # the records at the start of this run
        self.received_before: dict[tuple[str, int], Shape] = {}
        self.posted = {what: _Posted() for what in DIRECTIONS}
        self.unsent: dict[str, deque[int]] = {what: deque() for what in DIRECTIONS}  # this run, in order
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.context = ""  # the schedule's name, for error messages
        self.mailbox: Mailbox | None = None  # set by the first start() when a neighbour shares this host
        self.boxed: set[int] = set()  # the neighbours (global ranks) reached through the mailbox
        # direction -> the neighbour (global rank) it is received from / sent to by mailbox, or None
        self.box_from: dict[str, int | None] = dict.fromkeys(DIRECTIONS)
        self.box_to: dict[str, int | None] = dict.fromkeys(DIRECTIONS)
        self.metas: dict[Shape, bytes] = {}  # a shape's header, packed as a mailbox message's meta
        self.shapes: dict[bytes, Shape] = {}  # and back
        self.checked_host = False

    def peer(self, what: str, sending: bool) -> int:
        """Stage j's partner for a transfer of `what` (activations flow to j+1, gradients to j-1)."""
        up = (what == "activation") == sending
        return self.stage + (1 if up else -1)

    def local(self, what: str, sending: bool) -> bool:
        """Whether this transfer's partner is a stage of this same rank (handed over in memory)."""
        j = self.peer(what, sending)
        return (
            self.loopback is not None and 0 <= j < len(self.ranks) and self.ranks[j] == self.ranks[self.stage]
        )

    def start(self, receives: list[tuple[str, int]], sends: list[tuple[str, int]], context: str) -> None:
        """Post the run's receives of known shape (packed) and the headers of the others (in order)."""
        receives = [(w, i) for w, i in receives if not self.local(w, False)]
        sends = [(w, i) for w, i in sends if not self.local(w, True)]
        self.context = context
        self.early = dist.get_backend() != "nccl"
        if not self.checked_host:
            self._shared_memory()
            self.checked_host = True
        self.posted = {what: _Posted() for what in DIRECTIONS}
        self.unsent = {what: deque(i for w, i in sends if w == what) for what in DIRECTIONS}
        self.received_now = set()
        self.sent_before, self.received_before = dict(self.sent), dict(self.received)
        if not self.early:
            return
        for what, i in receives:
            if self.box_from[what] is not None:
                continue
            # an activation: the shape it had last run; a gradient: the shape its activation had then
            known = self.received_before if what == "activation" else self.sent_before
            if ("activation", i) in known:
                self._post(what, i, known[("activation", i)])
            elif what == "activation":
                header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                self.posted[what].headers.append((self._irecv(header, what, HEADER_TAG[what]), header))
            # else a gradient's receive is posted by expect(), once its activation was sent

    def _neighbours(self) -> list[int]:
        me = self.ranks[self.stage]
        return [
            self.ranks[j]
            for j in (self.stage - 1, self.stage + 1)
            if 0 <= j < len(self.ranks) and self.ranks[j] != me
        ]

    def _shared_memory(self) -> None:
        """Use the mailbox with each neighbour that is a CPU process of this host (a decision both
        ends of a pair make alike: it depends only on the pair's hosts and the settings)."""
        if self.device.type != "cpu" or dist.get_backend() != "gloo" or shm.transport() == "p2p":
            return
        box = mailbox(self.timeout_s)
        self.boxed = {r for r in self._neighbours() if box.same_host(r)}
        self.mailbox = box if self.boxed else None
        for what in DIRECTIONS:  # looked up once: every transfer asks
            self.box_from[what] = self._boxed_peer(what, sending=False)
            self.box_to[what] = self._boxed_peer(what, sending=True)

    def _boxed_peer(self, what: str, sending: bool) -> int | None:
        """The neighbour (global rank) this stage sends or receives `what` to or from through the
        mailbox; None if there is none or it is not reached through the mailbox."""
        j = self.peer(what, sending)
        return self.ranks[j] if 0 <= j < len(self.ranks) and self.ranks[j] in self.boxed else None

    def expect(self, what: str, i: int, shape: Shape) -> None:
        """Micro-batch i's `what` will have this shape: post its receive unless start() did."""
        if self.local(what, False):
            return
        self.received[(what, i)] = shape
        if self.box_from[what] is not None:
            return
        if self.early and i not in self.posted[what].early:
            self._post(what, i, shape)

    def _post(self, what: str, i: int, shape: Shape) -> None:
        buf = torch.empty(_nbytes(shape), dtype=torch.uint8, device=self.device)
        self.posted[what].early[i] = (self._irecv(buf, what, _data_tag(what, i, False)), buf, shape)

    def _posted_shape(self, what: str, i: int) -> Shape | None:
        """The shape the receiver of (what, i) posted a packed receive for in this run (None: none).

        The mirror of start() and expect() on the receiving stage: an activation's receive is posted
        with last run's shape; a gradient's with its activation's shape of last run, or of this run
        (posted after its forward) when the activation is new.
        """
        if what == "activation":
            return self.sent_before.get((what, i))
        if ("activation", i) in self.received_before:
            return self.received_before[("activation", i)]
        if ("activation", i) in self.received_now:
            return self.received[("activation", i)]
        return None

    def send(self, what: str, i: int, t: torch.Tensor) -> None:
        """Send micro-batch i's activation or gradient without waiting for it to leave."""
        if self.loopback is not None and self.local(what, True):
            self.loopback[(what, i)] = t.detach()
            return
        shape: Shape = (tuple(t.shape), t.dtype)
        unsent = self.unsent[what]
        if unsent and unsent[0] == i:
            unsent.popleft()
        peer = self.box_to[what]
        if self.mailbox is not None and peer is not None:
            meta = self.metas.get(shape)
            if meta is None:  # packed once per shape: between two actions every statement counts
                meta = self.metas[shape] = HEADER_STRUCT.pack(*_header_values(shape))
            self.mailbox.send(peer, i, t, meta)
            self.sent[(what, i)] = shape
            return
        values = _header_values(shape)
        t = t.detach().contiguous()
        posted = self._posted_shape(what, i) if self.early else None
        parts: list[tuple[torch.Tensor, int]]
        if not self.early:
            parts = [(_header(values, self.device), 0), (t, 0)]
        elif posted == shape:
            parts = [(_packed(values, shape, t, self.device), _data_tag(what, i, False))]
        elif posted is not None:  # the header in the receive posted for the old shape, then the data
            parts = [(_packed(values, posted, None, self.device), _data_tag(what, i, False))]
            parts.append((t, _data_tag(what, i, True)))
        else:
            parts = [(_header(values, self.device), HEADER_TAG[what]), (t, _data_tag(what, i, True))]
        for part, tag in parts:
            self._isend(part, what, tag)
        self.sent[(what, i)] = shape

    def recv(self, what: str, i: int) -> torch.Tensor:
        """Micro-batch i's activation (from j-1) or gradient (from j+1); raises Aborted on an abort."""
        if self.loopback is not None and self.local(what, False):
            return self.loopback.pop((what, i))
        peer = self.box_from[what]
        if self.mailbox is not None and peer is not None:
            # a view of the sender's slot, no copy: the sender writes key i again only in its next
            # run, which starts after this stage has sent back (or used) everything of this run
            _, meta, slot = self.mailbox.receive(peer, (i, ABORT_KEY), f"the {what} of micro-batch {i}")
            shape = self.shapes.get(meta)
            if shape is None:  # a header not seen before (an abort is never remembered)
                values = list(HEADER_STRUCT.unpack(meta))
                self._check_abort(values, what)
                shape = self.shapes[meta] = _shape_of(values)
            return self._received(what, i, shape, self.mailbox.view(slot, shape[1], shape[0]))
        posted = self.posted[what]
        early = posted.early.pop(i, None)
        if early is not None:
            work, buf, shape = early
            self.wait(work, f"the {what}", i)
            values = [int(v) for v in buf[:HEADER_BYTES].view(torch.int64).tolist()]
            self._check_abort(values, what)
            if _shape_of(values) == shape:
                return self._received(what, i, shape, _data(buf, shape))
        else:
            if posted.headers:
                work, header = posted.headers.popleft()
            else:
                header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                work = self._irecv(header, what, HEADER_TAG[what] if self.early else 0)
            self.wait(work, f"the header of the {what}", i)
            values = [int(v) for v in header.tolist()]
            self._check_abort(values, what)
        shape = _shape_of(values)
        out = torch.empty(shape[0], dtype=shape[1], device=self.device)
        self.wait(self._irecv(out, what, _data_tag(what, i, True) if self.early else 0), f"the {what}", i)
        return self._received(what, i, shape, out)

    def _received(self, what: str, i: int, shape: Shape, t: torch.Tensor) -> torch.Tensor:
        self.received[(what, i)] = shape
        self.received_now.add((what, i))
        return t

    def _check_abort(self, values: list[int], what: str) -> None:
        if values[0] == ABORT:
            raise Aborted(
                f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) stops: stage "
                f"{values[1]} (rank {self.ranks[values[1]]}) failed; see that rank's error",
                values[1],
                self.peer(what, sending=False),
            )

    def finish(self) -> None:
        """Wait until every send of the run has left."""
        for work, _ in self.sends:
            self.wait(work, "a send", -1)
        self.sends.clear()

    def _isend(self, t: torch.Tensor, what: str, tag: int) -> dist.Work:
        """Send without waiting; the tensor is kept until finish(): gloo drops a send whose buffer dies."""
        work = dist.isend(t, self.ranks[self.peer(what, sending=True)], tag=tag)
        assert work is not None, "isend to another rank returns a Work"
        self.sends.append((work, t))
        return work

    def _irecv(self, buf: torch.Tensor, what: str, tag: int) -> dist.Work:
        work = dist.irecv(buf, self.ranks[self.peer(what, sending=False)], tag=tag)
        assert work is not None, "irecv from another rank returns a Work"
        return work

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
        """Tell the neighbouring stages (but the one the abort came from) that stage `failed` failed.

        Each gets the abort where its next receive from this stage waits: in the packed message it
        posted, or on the header FIFO. A neighbour that expects nothing more, or whose posted shape
        this stage cannot know (a gradient whose activation never arrived), is left to its timeout.
        """
        values = _abort_values(failed)
        works = []
        for what in DIRECTIONS:
            peer = self.peer(what, sending=True)
            if not 0 <= peer < len(self.ranks) or peer == came_from or self.local(what, True):
                continue
            if self.mailbox is not None and self.ranks[peer] in self.boxed:
                empty = torch.empty(0, dtype=torch.uint8)
                with contextlib.suppress(OSError):  # a neighbour gone is left to its own checks
                    self.mailbox.send(self.ranks[peer], ABORT_KEY, empty, HEADER_STRUCT.pack(*values))
            elif not self.early:
                works.append(self._isend(_header(values, self.device), what, 0))
            elif self.unsent[what]:
                i = self.unsent[what][0]
                posted = self._posted_shape(what, i)
                if posted is not None:
                    works.append(
                        self._isend(
                            _packed(values, posted, None, self.device), what, _data_tag(what, i, False)
                        )
                    )
                elif what == "activation":
                    works.append(self._isend(_header(values, self.device), what, HEADER_TAG[what]))
        for work in works:  # a neighbour gone or stuck itself is left to its own timeout
            with contextlib.suppress(RuntimeError):
                work.wait(timeout=timedelta(seconds=ABORT_WAIT_S))
