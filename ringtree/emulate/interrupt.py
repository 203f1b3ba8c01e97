"""Ctrl-C and SIGTERM during an emulated run: raised as KeyboardInterrupt, and remembered.

Python drops an exception that is raised while a finalizer (`__del__`, a weakref callback) runs:
it prints "Exception ignored in ..." and carries on. A Ctrl-C that lands there would be lost and
the job would run to its end with the user's terminal waiting. So the signal also sets a flag
that the wait loop checks (`check`), and neither a mask nor an ignored SIGINT inherited from the
parent holds it back: a shell starts a background job (`cmd &`) with SIGINT ignored, and an emulate
run there must still stop and remove its nodes when sent one, as `ringtree train` and `bench` do
(torch's elastic launcher installs its handler whatever it inherits).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_Handler = Callable[[int, FrameType | None], Any] | int | None  # what signal.getsignal returns
_requested = threading.Event()


def _raise(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise KeyboardInterrupt and set the flag, whatever was inherited
    (ignored, blocked); restored on leaving."""
    _requested.clear()
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    for s in SIGNALS:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        _restore(previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _requested.clear()


def _restore(previous: dict[signal.Signals, _Handler]) -> None:
    """Put the handlers back (one installed outside Python reads as None: the default then)."""
    for s, handler in previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def check() -> None:
    """Raise KeyboardInterrupt if a signal came in whose exception Python may have dropped."""
    if _requested.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within: SIGINT and SIGTERM only take note (a second Ctrl-C must not leave debris half
    removed); one that came in is acted on, as KeyboardInterrupt, when the block ends."""
    came: list[int] = []
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        if previous[s] is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        _restore(previous)
        if came and callable(previous[signal.Signals(came[0])]):  # a handler, not SIG_IGN/SIG_DFL
            _requested.set()
            raise KeyboardInterrupt
