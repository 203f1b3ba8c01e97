"""A picture of a trace report: each rank's time by kind, each collective's busbw beside the model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_report(report: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = report.rank_rows()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [str(r["rank"]) for r in ranks]
    bottom = [0.0] * len(ranks)
    for key, label in (
        ("compute_s", "compute"),
        ("exposed_comm_s", "exposed communication"),
        ("exposed_memcpy_s", "exposed memcpy"),
        ("idle_s", "idle"),
    ):
        values = [r[key] for r in ranks]
        left.bar(x, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_xlabel("rank")
    left.set_ylabel("seconds over the steps analysed")
    left.set_title("where each rank's time goes")
    left.legend(fontsize=8)
    rows = [r for r in report.collectives if r.nbytes > 0][:12]
    labels = [f"{r.op}\n{r.nbytes / 1e6:.1f} MB" for r in rows]
    right.barh(labels, [r.busbw_gbps for r in rows], label="measured")
    modelled = [(i, r.model_busbw_gbps) for i, r in enumerate(rows) if r.model_busbw_gbps]
    if modelled:
        right.scatter(
            [m for _, m in modelled],
            [i for i, _ in modelled],
            color="black",
            marker="|",
            s=200,
            label="model",
            zorder=3,
        )
    right.invert_yaxis()
    right.set_xlabel("busbw (GB/s)")
    right.set_title("collectives, the most time first")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
