"""Ring attention on a clock: which K/V block each context-parallel rank holds at each step, which
(query chunk, key chunk) blocks it computes and which it skips under the causal mask, and the
head-tail layout that gives every rank the same work. The steps are ringtree.schedules.ring_attention's,
the ones ringtree.parallel.context runs.
"""

from __future__ import annotations

from typing import Any

from ringtree.schedules.ring_attention import (
    CAUSAL,
    FULL,
    SKIP,
    RingStep,
    chunks,
    exchanges,
    ring_steps,
    work,
)

NAME = "ring-attention"
MARK = {FULL: "full", CAUSAL: "causal", SKIP: "skip"}


def cell(s: RingStep, p: int, balanced: bool) -> str:
    """One rank at one step: the K/V it holds (whose, which chunks) and each block's fate."""
    held = ",".join(map(str, chunks(s.source, p, balanced)))
    done = ", ".join(f"q{b.q}-k{b.k} {MARK[b.kind]}" for b in s.blocks if b.kind != SKIP)
    skipped = [f"q{b.q}-k{b.k}" for b in s.blocks if b.kind == SKIP]
    text = f"K/V {held} (rank {s.source}): {done}"
    return text + (f"; skip {', '.join(skipped)}" if skipped else "")


def communication(step: int, p: int) -> str:
    """What moves during a step (forward; backward repeats it and sends dK/dV along)."""
    if step + 1 < p:
        return "K/V to r+1, from r-1"
    return "none"


def report(p: int, causal: bool = True, balanced: bool = True) -> dict[str, Any]:
    """The whole ring as data: the --json of `ringtree show ring-attention`."""
    steps = ring_steps(p, causal, balanced)
    return {
        "ranks": p,
        "causal": causal,
        "load_balanced": balanced,
        "chunks": [list(chunks(r, p, balanced)) for r in range(p)],
        "steps": [
            {
                "step": k,
                "communication": communication(k, p),
                "ranks": [
                    {
                        "rank": s.rank,
                        "kv_from": s.source,
                        "kv_chunks": list(chunks(s.source, p, balanced)),
                        "blocks": [{"q": b.q, "k": b.k, "kind": b.kind} for b in s.blocks],
                    }
                    for s in row
                ],
            }
            for k, row in enumerate(steps)
        ],
        "work": work(steps),
        "exchanges": {comm: exchanges(p, comm) for comm in ("p2p", "all-gather", "all-to-all")},
    }


def plot_ring_attention(p: int, path: object, causal: bool = True, balanced: bool = True) -> None:
    """Left: the chunk-by-chunk attention matrix, each block coloured by the rank that computes it and
    labelled with the step; blank where the causal mask skips it. Right: rank x step, whose K/V is held."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    steps = ring_steps(p, causal, balanced)
    n = p * (2 if balanced else 1)
    colours = plt.get_cmap("tab10" if p <= 10 else "tab20")
    fig, (left, right) = plt.subplots(1, 2, figsize=(5.0 + 0.5 * n + 0.4 * p, 0.45 * n + 2.4))
    for row in steps:
        for s in row:
            for b in s.computed:
                left.add_patch(Rectangle((b.k, b.q), 1, 1, color=colours(s.rank % 20), alpha=0.85))
                label = f"s{s.step}" + ("◣" if b.kind == CAUSAL else "")
                left.text(b.k + 0.5, b.q + 0.5, label, ha="center", va="center", fontsize=7)
    left.set_xlim(0, n)
    left.set_ylim(n, 0)
    left.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
    left.set_yticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
    left.set_xlabel("key chunk")
    left.set_ylabel("query chunk")
    left.set_aspect("equal")
    left.set_title("block: colour = rank computing it, sN = step", fontsize=8)
    for r in range(p):
        for k in range(p):
            src = steps[k][r].source
            right.add_patch(Rectangle((k, r), 1, 1, color=colours(src % 20), alpha=0.6))
            kv = ",".join(map(str, chunks(src, p, balanced)))
            right.text(k + 0.5, r + 0.5, f"K/V {kv}", ha="center", va="center", fontsize=7)
    right.set_xlim(0, p)
    right.set_ylim(p, 0)
    right.set_xticks([k + 0.5 for k in range(p)], [str(k) for k in range(p)])
    names = [f"rank {r}: q {','.join(map(str, chunks(r, p, balanced)))}" for r in range(p)]
    right.set_yticks([r + 0.5 for r in range(p)], names)
    right.set_xlabel("step (K/V move to rank r+1 between steps)")
    right.set_title("K/V chunks each rank holds (colour = owner)", fontsize=8)
    layout = "head-tail" if balanced else "contiguous"
    mask = "causal" if causal else "full"
    fig.suptitle(f"ring attention on {p} ranks: {mask} mask, {layout} chunks", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
