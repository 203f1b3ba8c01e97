"""The simulator: a hardware model, closed-form and replayed all-reduce times, a planner, calibration.

Pure Python and numpy: nothing here imports torch, so `ringtree plan` starts fast and runs anywhere.
"""

from ringtree.sim.allreduce import METHODS, Estimate, allreduce_time
from ringtree.sim.closed_form import ALGORITHMS, estimate
from ringtree.sim.hardware import Cluster, Link
from ringtree.sim.presets import INTER, INTRA
from ringtree.sim.replay import replay_all_reduce
from ringtree.sim.spec import make_cluster

__all__ = [
    "ALGORITHMS",
    "INTER",
    "INTRA",
    "METHODS",
    "Cluster",
    "Estimate",
    "Link",
    "allreduce_time",
    "estimate",
    "make_cluster",
    "replay_all_reduce",
]
