"""The planner's predicted step time for a finished run, when the simulator and a calibration exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def predicted_step_time(summary: dict[str, Any], calibration: Path | None) -> float | None:
    """ringtree.sim.training.plan's step time for this run's setup on the calibrated machine, else None.

    The compute time fed to the planner is the measured one (step time minus exposed
    communication), so the prediction tests the planner's communication model and overlap.
    """
    if calibration is None:
        return None
    try:
        from ringtree.sim.network.closed_form import ALGORITHMS
        from ringtree.sim.network.spec import make_cluster
        from ringtree.sim.training.plan import StepConfig, predict_step
    except ImportError:  # a build without the simulator
        return None
    if summary["algorithm"] not in ALGORITHMS or summary["mode"] != "ddp" or summary.get("pp", 1) > 1:
        return None  # torch's native algorithm, the master-rank dp mode and pipelines are not modelled
    config = StepConfig.from_summary(summary)
    nodes = summary["nodes"]
    cluster = make_cluster(nodes, summary["world_size"] // nodes, calibration=calibration)
    return predict_step(config, cluster, summary["algorithm"]).step_s
