"""Context parallelism: each sequence split over ranks, attention over the whole of it (ring,
all-gather or Ulysses), head-tail load balancing for causal masks."""

from ringtree.parallel.context.api import SDPA, ContextAttention, ContextParallel, has_attention
from ringtree.parallel.context.layout import Layout
from ringtree.parallel.context.ring import ring_attention
from ringtree.schedules.ring_attention import COMMS

__all__ = [
    "COMMS",
    "SDPA",
    "ContextAttention",
    "ContextParallel",
    "Layout",
    "has_attention",
    "ring_attention",
]
