"""One MoE layer's token dispatch over expert-parallel ranks, step by step (pure data, no torch).

P ranks, E experts (rank r holds experts r E/P .. (r+1) E/P - 1), T tokens per rank, top-k
routing drawn from a fixed seed. The steps are those of ringtree/parallel/moe/dispatch.py: sort
the copies by expert, exchange the counts (every rank learns the whole split matrix), the
dispatch all-to-all, the permute to expert-major order, the experts, the combine all-to-all,
the weighted sum on the sender; in backward the combine's and the dispatch's all-to-alls again,
their splits swapped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

MOE_SHOWS = ("moe-dispatch",)
TOKENS = 4  # tokens per rank shown
TOP_K = 2


@dataclass(frozen=True)
class DispatchStep:
    """What one step does; per rank, a line of what it holds or sends."""

    action: str
    comm: str  # the collective, or "" when the step is local
    ranks: list[str]
    sends: list[list[int]] = field(default_factory=list)  # [from][to] rows, for an all-to-all


def routing(
    p: int, experts: int, tokens: int = TOKENS, top_k: int = TOP_K, seed: int = 0
) -> list[list[list[int]]]:
    """[rank][token] -> its top-k experts (distinct), drawn from `seed`."""
    rng = random.Random(seed)
    return [[sorted(rng.sample(range(experts), top_k)) for _ in range(tokens)] for _ in range(p)]


def owner(expert: int, p: int, experts: int) -> int:
    return expert // (experts // p)


def dispatch_steps(p: int, experts: int, tokens: int = TOKENS, top_k: int = TOP_K) -> list[DispatchStep]:
    """The steps of one MoE layer's forward and backward over p EP ranks."""
    if p < 1 or experts % p:
        raise ValueError(f"--ranks {p} must divide --experts {experts} (each rank holds whole experts)")
    if top_k > experts:
        raise ValueError(f"top-k {top_k} is above --experts {experts}")
    route = routing(p, experts, tokens, top_k)
    local = experts // p
    copies = [sorted((e, t) for t, chosen in enumerate(route[r]) for e in chosen) for r in range(p)]
    counts = [[sum(1 for e, _ in copies[r] if e == x) for x in range(experts)] for r in range(p)]
    sends = [[sum(counts[i][j * local : (j + 1) * local]) for j in range(p)] for i in range(p)]
    back = [[sends[j][i] for j in range(p)] for i in range(p)]

    def label(rank: int, token: int) -> str:
        return f"r{rank}t{token}"

    steps = [
        DispatchStep(
            "route: top-k experts of each token",
            "",
            [
                " ".join(f"{label(r, t)}->e{'/e'.join(map(str, ch))}" for t, ch in enumerate(route[r]))
                for r in range(p)
            ],
        ),
        DispatchStep(
            "sort the copies by expert (rank-major too)",
            "",
            [" ".join(f"e{e}:{label(r, t)}" for e, t in copies[r]) for r in range(p)],
        ),
        DispatchStep(
            "counts exchange: each rank's copies per expert, to every rank",
            f"all-to-all, equal splits ({experts} integers per pair: an all-gather)",
            [f"e0..e{experts - 1}: {counts[r]}" for r in range(p)],
            [[experts] * p for _ in range(p)],
        ),
        DispatchStep(
            "dispatch: the rows go to their experts' ranks",
            "all-to-all, variable splits (rows per pair)",
            [f"sends {sends[r]}, receives {back[r]}" for r in range(p)],
            sends,
        ),
    ]
    arrived = [
        [(e, label(s, t)) for s in range(p) for e, t in copies[s] if owner(e, p, experts) == r]
        for r in range(p)
    ]
    steps.append(
        DispatchStep(
            "permute to expert-major order; experts compute",
            "",
            [
                " ".join(f"e{e}:{who}" for e, who in sorted(arrived[r], key=lambda x: x[0])) or "(no tokens)"
                for r in range(p)
            ],
        )
    )
    steps += [
        DispatchStep(
            "combine: the outputs return (splits swapped)",
            "all-to-all, variable splits",
            [f"sends {back[r]}, receives {sends[r]}" for r in range(p)],
            back,
        ),
        DispatchStep(
            "weighted sum of each token's k outputs, scores on the sender",
            "",
            [f"{tokens} tokens x {top_k} copies" for _ in range(p)],
        ),
        DispatchStep(
            "backward of the combine: output gradients to the experts",
            "all-to-all, the dispatch's splits",
            [f"sends {sends[r]}, receives {back[r]}" for r in range(p)],
            sends,
        ),
        DispatchStep(
            "backward of the dispatch: input gradients home",
            "all-to-all, the combine's splits",
            [f"sends {back[r]}, receives {sends[r]}" for r in range(p)],
            back,
        ),
    ]
    return steps


def plot_dispatch(steps: list[DispatchStep], p: int, experts: int, path: str) -> None:
    """The dispatch's rows per rank pair, and the combine's (its transpose), as two grids."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = [(s.action.split(":")[0], s.sends) for s in steps if s.comm.startswith("all-to-all, variable")][
        :2
    ]
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 3.8))
    for ax, (title, grid) in zip(axes, grids, strict=True):
        top = max(max(row) for row in grid) or 1
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=top * 1.6)  # light enough for black numbers
        for i in range(p):
            for j in range(p):
                ax.text(j, i, str(grid[i][j]), ha="center", va="center", fontsize=9)
        ax.set_xticks(range(p))
        ax.set_yticks(range(p))
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        ax.set_title(f"{title} (rows)", fontsize=10)
    fig.suptitle(
        f"MoE dispatch: {p} EP ranks, {experts} experts, {TOKENS} tokens a rank, top-{TOP_K}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
