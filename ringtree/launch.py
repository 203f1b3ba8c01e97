"""The worker-process functions of `ringtree.processes`, also importable as `ringtree.launch`.

Scripts written against `ringtree.launch.spawn` (or `elastic_spawn`, `restart_count`, ...) keep
working; new code imports `ringtree.processes`.
"""

from ringtree.processes import (
    default_backend,
    elastic_spawn,
    init_from_env,
    restart_count,
    run_under_torchrun,
    spawn,
    under_torchrun,
    whole_lines,
)

__all__ = [
    "default_backend",
    "elastic_spawn",
    "init_from_env",
    "restart_count",
    "run_under_torchrun",
    "spawn",
    "under_torchrun",
    "whole_lines",
]
