"""The reader of ringtree's own `--trace` timeline (`ringtree train --trace FILE`): one Chrome
trace for the whole world, a process per rank, in Kineto's vocabulary (ProfilerStep# spans,
collectives with Kineto's collective arguments), so the same analysis reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringtree.trace.events import RankTrace

MARK = "ringtree"  # the top-level key that tells ringtree's timeline from a Kineto trace


def is_timeline(doc: Mapping[str, Any]) -> bool:
    return isinstance(doc.get(MARK), dict)


def read(doc: Mapping[str, Any], path: str) -> list[RankTrace]:
    raise ValueError(f"{path}: ringtree's timeline format is not readable yet")
