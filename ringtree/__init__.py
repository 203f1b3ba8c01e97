"""ringtree: every classic all-reduce, a simulator that predicts them, and parallel training."""

from ringtree.topology import Topology

__version__ = "0.1.0"
__all__ = ["Topology", "__version__"]
