"""`ringtree plan`: the transformer planner, the data-parallel planner and --from-run behind one
command (`command`), each planner's options and output in its own module."""

from ringtree.cli.plan import command as command
from ringtree.cli.plan.cluster import ClusterOptions
from ringtree.cli.plan.data_parallel import parse_count

__all__ = ["ClusterOptions", "command", "parse_count"]
