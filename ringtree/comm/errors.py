"""Errors raised by collectives: a failed or timed-out peer, or ranks that disagree."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer died, timed out, or the transport failed.

    Raised on every live rank, naming the operation, the step and (where known) the peer.
    """

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class MismatchError(ValueError):
    """Ranks called the same collective with different arguments (size, dtype, op, algorithm)."""
