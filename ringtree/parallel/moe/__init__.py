"""Mixture of experts: the router, the experts, the token dispatch and the MoE layer."""

from ringtree.parallel.moe.alltoall import A2A_ALGORITHMS, CLOCK
from ringtree.parallel.moe.dispatch import AllToAllDispatcher, LocalDispatcher, expert_major, sort_by_expert
from ringtree.parallel.moe.experts import GroupedExperts
from ringtree.parallel.moe.layer import MoE, SharedExperts
from ringtree.parallel.moe.router import Router, Routing

__all__ = [
    "A2A_ALGORITHMS",
    "CLOCK",
    "AllToAllDispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "Router",
    "Routing",
    "SharedExperts",
    "expert_major",
    "sort_by_expert",
]
