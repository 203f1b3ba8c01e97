"""Schedules shown step by step: per-rank moves and holdings, trees, costs, pipeline timelines (no torch)."""

from ringtree.show.cost import Cost, cost, make_cluster
from ringtree.show.pipeline import Timeline, timeline
from ringtree.show.steps import Walkthrough, walk
from ringtree.show.trees import trees_of

__all__ = ["Cost", "Timeline", "Walkthrough", "cost", "make_cluster", "timeline", "trees_of", "walk"]
