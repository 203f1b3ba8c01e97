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


def plot_sim_sweep(
    rows: list[dict[str, Any]], x_key: str, path: Path, title: str, collective: str = "all-reduce"
) -> None:
    """Predicted collective time against size or ranks, one line per algorithm (log-log)."""
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
    ax.set_ylabel(f"{collective} time (s)")
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

    spans: {"stage", "kind" ("forward", "backward", "weight", anything else grey), "micro_batch", "start",
    "end"}
    with times in seconds.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward": "tab:blue", "backward": "tab:orange"}
    labels = {"forward": "forward", "backward": "backward"}
    if any(s["kind"] == "weight" for s in spans):  # a split backward: B and W apart
        colours["weight"] = "tab:green"
        labels = {"forward": "F forward", "backward": "B input gradient", "weight": "W weight gradient"}
    origin = min((s["start"] for s in spans), default=0.0)
    stages = sorted({s["stage"] for s in spans})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(stages) + 1.6))
    size = 7 if len(spans) <= 40 * max(1, len(stages)) else 5  # many boxes a row (two chunks): smaller labels
    for s in spans:
        left, width = (s["start"] - origin) * 1e3, (s["end"] - s["start"]) * 1e3
        ax.barh(
            s["stage"], width, left=left, color=colours.get(s["kind"], "tab:gray"), edgecolor="black", lw=0.4
        )
        if s["kind"] in colours and width > 0:
            ax.text(
                left + width / 2, s["stage"], str(s["micro_batch"]), ha="center", va="center", fontsize=size
            )
    ax.set_yticks(stages, [f"stage {j}" for j in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=labels[k]) for k, c in colours.items()]
    if "weight" in colours:  # the rows run to the right edge: the legend goes outside, on the right
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    else:
        ax.legend(handles=handles)
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


def plot_trees(trees: list[dict[str, Any]], path: Path, title: str) -> None:
    """Trees side by side, as NCCL draws its double binary tree: one colour per tree, interior ranks
    filled, leaves hollow, each rank at its in-order column and its depth.

    trees: {"title", "parent": {rank: parent or -1}, "x": {rank: column}, "depth": {rank: depth}}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = ["tab:blue", "tab:orange", "tab:green"]
    width = max(len(t["x"]) for t in trees)
    fig, axes = plt.subplots(1, len(trees), figsize=(max(4.0, 0.45 * width) * len(trees), 3.8), squeeze=False)
    for ax, tree, colour in zip(axes[0], trees, colours, strict=False):
        x, depth, parent = tree["x"], tree["depth"], tree["parent"]
        interior = {up for up in parent.values() if up >= 0}
        for r, up in parent.items():
            if up >= 0:
                ax.plot([x[r], x[up]], [-depth[r], -depth[up]], color=colour, lw=1.5, zorder=1)
        for r in x:
            filled = r in interior
            ax.scatter(x[r], -depth[r], s=420, zorder=2, edgecolors=colour, linewidths=2,
                       facecolors=colour if filled else "white")  # fmt: skip
            ax.text(x[r], -depth[r], str(r), ha="center", va="center", fontsize=8, zorder=3,
                    color="white" if filled else "black")  # fmt: skip
        ax.set_title(tree["title"], fontsize=9, color=colour)
        ax.set_xlim(-0.8, width - 0.2)
        ax.set_ylim(-max(depth.values()) - 0.6, 0.6)
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


HOLDINGS_LEGEND = (
    "number: how many ranks' inputs the chunk holds (Σ: all of them); red outline: received in this step"
)


def _draw_holdings(ax: Any, frame: dict[str, Any], p: int, per_node: int | None = None) -> None:
    """One step's holdings: ranks x chunks, shaded by how many ranks' inputs each chunk holds; the
    chunks received in the step outlined in red; with per_node, a line between nodes' ranks."""
    from matplotlib.patches import Rectangle

    held = frame["held"]
    ax.imshow(held, cmap="Blues", vmin=0, vmax=p, aspect="auto")
    if len(held) <= 16 and len(held[0]) <= 16:
        for r, row in enumerate(held):
            for c, count in enumerate(row):
                ax.text(c, r, "Σ" if count == p else str(count) if count else "", ha="center", va="center",
                        fontsize=7, color="white" if count > p / 2 else "black")  # fmt: skip
    for r, c in frame.get("received", []):
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="tab:red", lw=1.5))
    ax.set_title(frame["title"], fontsize=8)
    ax.set_xlabel("chunk", fontsize=7)
    ax.set_ylabel("rank", fontsize=7)
    ax.set_xticks(range(len(held[0])))
    ax.set_yticks(range(len(held)))
    if per_node is not None and per_node < len(held):
        for boundary in range(per_node, len(held), per_node):
            ax.axhline(boundary - 0.5, color="black", lw=1.2, ls="--")
        ax.set_yticks(range(len(held)), [f"{r} (n{r // per_node})" for r in range(len(held))])
        ax.set_ylabel("rank (node)", fontsize=7)
    ax.tick_params(labelsize=6)


def plot_holdings(
    frames: list[dict[str, Any]], p: int, path: Path, title: str, per_node: int | None = None
) -> None:
    """Small multiples, one per step: what every rank holds of every chunk (number of contributions,
    Σ when all p are in), the chunks received in that step outlined in red; with per_node (ranks
    per node, several nodes), dashed lines between the nodes and each rank's node on its label.
    A legend under the panels says what the numbers and outlines mean.

    frames: {"title", "held": [[count per chunk] per rank], "received": [(rank, chunk), ...]}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(frames))
    rows = -(-len(frames) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(frames) :]:
        ax.axis("off")
    for ax, frame in zip(axes.flat, frames, strict=False):
        _draw_holdings(ax, frame, p, per_node)
    fig.suptitle(title, fontsize=10)
    nodes = "; dashed lines: between nodes (n0, n1, ...)" if per_node is not None and per_node < p else ""
    fig.text(0.5, 0.005, HOLDINGS_LEGEND + nodes, ha="center", va="bottom", fontsize=7)
    _save(fig, path, rect=(0, 0.04, 1, 1))


def animate_holdings(frames: list[dict[str, Any]], p: int, path: Path, title: str) -> None:
    """The frames of `plot_holdings` as a GIF, one step per second (matplotlib's PillowWriter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter

    fig, ax = plt.subplots(figsize=(5, 4))

    def draw(k: int) -> list[Any]:
        ax.clear()
        _draw_holdings(ax, frames[k], p)
        fig.suptitle(title, fontsize=9)
        return []

    path.parent.mkdir(parents=True, exist_ok=True)
    FuncAnimation(fig, draw, frames=len(frames)).save(path, writer=PillowWriter(fps=1))
    plt.close(fig)


def plot_all_to_all(frames: list[dict[str, Any]], p: int, path: Path, title: str) -> None:
    """Small multiples, one per step: which blocks every rank holds (rows: ranks; columns: blocks
    grouped by destination, coloured by source rank), the blocks received in that step outlined.

    frames: {"title", "held": [[source + 1 or 0 per block] per rank], "received": [(rank, block)]}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    names: list[str] = ["white", *[f"C{i % 10}" for i in range(p)]]
    colours = ListedColormap(names)
    fig, axes = plt.subplots(
        len(frames), 1, figsize=(max(5.0, 0.32 * p * p + 1.5), 0.45 * p * len(frames) + 1.2)
    )
    for ax, frame in zip(axes if len(frames) > 1 else [axes], frames, strict=True):
        ax.imshow(frame["held"], cmap=colours, vmin=0, vmax=p, aspect="auto", interpolation="nearest")
        for r, k in frame["received"]:
            ax.add_patch(Rectangle((k - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.6))
        for j in range(1, p):
            ax.axvline(j * p - 0.5, color="grey", lw=0.8)
        ax.set_xticks([j * p + (p - 1) / 2 for j in range(p)], [f"blocks for rank {j}" for j in range(p)])
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.tick_params(labelsize=7, length=0)
        ax.set_title(frame["title"], fontsize=8, loc="left")
    fig.suptitle(title + "\ncolour: the block's source rank; outlined: received in this step", fontsize=9)
    _save(fig, path)


def _save(fig: Any, path: Path, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out (within rect, leaving room for a legend), write the PNG (creating its folder) and
    free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
