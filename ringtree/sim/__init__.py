"""The simulator: the collective and network model (`network`) and the training planner (`training`).

Pure Python and numpy: nothing here imports torch, so `ringtree plan` starts fast and runs anywhere.
"""

from ringtree.sim.network.allreduce import METHODS, Estimate, allreduce_time
from ringtree.sim.network.closed_form import ALGORITHMS, estimate
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.network.presets import INTER, INTRA
from ringtree.sim.network.replay import replay_all_reduce
from ringtree.sim.network.spec import make_cluster

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
