"""PNG plots (matplotlib, headless): benchmark curves."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ringtree.units import format_size


def plot_bench(rows: list[dict[str, Any]], path: Path, env: dict[str, Any]) -> None:
    """busbw and time against size, one line per algorithm, environment in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_alg: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["bytes"] > 0:
            by_alg[r["algorithm"]].append(r)
    fig, (bw, tm) = plt.subplots(1, 2, figsize=(12, 4.5))
    for alg, rs in by_alg.items():
        sizes = [r["bytes"] for r in rs]
        bw.plot(sizes, [r["busbw_gbps"] for r in rs], marker="o", ms=3, label=alg)
        tm.plot(sizes, [r["time_us"] for r in rs], marker="o", ms=3, label=alg)
    for ax, label in ((bw, "busbw (GB/s)"), (tm, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ticks = sorted({r["bytes"] for r in rows if r["bytes"] > 0})[::2]
        ax.set_xticks(ticks, [format_size(t) for t in ticks], rotation=45)
    tm.set_yscale("log")
    bw.legend()
    collective = rows[0]["collective"] if rows else ""
    fig.suptitle(
        f"{collective}, {env.get('world_size')} ranks, {env.get('backend')}, "
        f"torch {env.get('torch')}, {env.get('host_cores')} cores"
    )
    _save(fig, path)


def plot_sim_sweep(rows: list[dict[str, Any]], x_key: str, path: Path, title: str) -> None:
    """Predicted all-reduce time against size or ranks, one line per algorithm (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_alg: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_alg[r["algorithm"]].append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for alg, rs in by_alg.items():
        ax.plot([r[x_key] for r in rs], [r["time_s"] for r in rs], marker="o", ms=3, label=alg)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)" if x_key == "bytes" else "ranks")
    ax.set_ylabel("all-reduce time (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def plot_scaling(nodes: list[int], curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Speedup over one node against node count, one line per algorithm, the ideal line beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot(nodes, nodes, linestyle="--", color="gray", label="ideal")
    for alg, speedups in curves.items():
        ax.plot(nodes, speedups, marker="o", ms=3, label=alg)
    ax.set_xlabel("nodes")
    ax.set_ylabel("throughput speedup over one node")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def plot_gantt(spans: list[dict[str, Any]], path: Path, title: str) -> None:
    """A pipeline's timeline: one row per stage, forwards and backwards coloured, micro-batch numbers on them.

    spans: {"stage", "kind" ("forward", "backward", anything else grey), "micro_batch", "start", "end"}
    with times in seconds.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward": "tab:blue", "backward": "tab:orange"}
    origin = min((s["start"] for s in spans), default=0.0)
    stages = sorted({s["stage"] for s in spans})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(stages) + 1.6))
    for s in spans:
        left, width = (s["start"] - origin) * 1e3, (s["end"] - s["start"]) * 1e3
        ax.barh(
            s["stage"], width, left=left, color=colours.get(s["kind"], "tab:gray"), edgecolor="black", lw=0.4
        )
        if s["kind"] in colours and width > 0:
            ax.text(left + width / 2, s["stage"], str(s["micro_batch"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(stages, [f"stage {j}" for j in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()])
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def plot_bubble(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Measured bubble fraction against micro-batches, beside (p-1)/(m+p-1), one colour per p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in sorted({r["stages"] for r in rows}):
        rs = sorted((r for r in rows if r["stages"] == p), key=lambda r: r["micro_batches"])
        m = [r["micro_batches"] for r in rs]
        line = ax.plot(m, [r["bubble_fraction"] for r in rs], marker="o", ms=3, label=f"p={p} measured")
        ax.plot(
            m,
            [r["theoretical_bubble_fraction"] for r in rs],
            "--",
            color=line[0].get_color(),
            label=f"p={p} (p-1)/(m+p-1)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
