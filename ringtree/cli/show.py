"""`ringtree show`: any collective or pipeline schedule, step by step, in the terminal and as pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from ringtree.cli.app import app
from ringtree.cli.output import check_output, console, write_json

FULL_RANKS = 8  # up to this many ranks every rank gets a column; beyond, ranks 0, 1 and p-1
FULL_STEPS = 32  # up to this many steps every step gets a row; beyond, the first and last 12
EDGE_STEPS = 12
DRAW_TREE_RANKS = 32  # wider trees do not fit a terminal: roles only (and --png)


@app.command()
def show(
    algorithm: str = typer.Argument(
        ...,
        help="A collective algorithm (ring, double_tree, ...), an all-to-all (pairwise, bruck, linear, "
        "hierarchical-a2a), a pipeline (gpipe, 1f1b, pipedream, zb-h1, zb-v, ...), a ZeRO step "
        "(zero1, zero2, zero3), ring-attention (context parallelism) or diloco (local training, "
        "outer syncs).",
    ),
    collective: str | None = typer.Option(
        None,
        help="all-reduce (default), reduce-scatter, all-gather, broadcast, reduce or all-to-all "
        "(underscores work too).",
    ),
    ranks: int | None = typer.Option(None, help="Ranks (collectives; default 4)."),
    nodes: int | None = typer.Option(None, help="Nodes the ranks are spread over, node by node (default 1)."),
    nbytes: str | None = typer.Option(
        None, "--bytes", help="Buffer size, e.g. 4K, 4M (default 4M, float32)."
    ),
    root: int | None = typer.Option(None, help="Root rank of broadcast and reduce (default 0)."),
    link: str | None = typer.Option(
        None,
        help="Link for alpha and beta: preset, FILE.json or 'bw=..,lat=..' (default eth-10g; inter-node).",
    ),
    intra: str | None = typer.Option(None, help="Link inside a node with --nodes 2+ (default pcie-gen3)."),
    stages: int | None = typer.Option(None, help="Pipeline stages (pipelines; default 4)."),
    micro_batches: int | None = typer.Option(None, help="Micro-batches (pipelines; default 8)."),
    virtual_stages: int | None = typer.Option(None, help="Model chunks per stage (interleaved; default 2)."),
    experts: int | None = typer.Option(None, help="Experts of an MoE layer (moe-dispatch; default 8)."),
    replicas: int | None = typer.Option(None, help="Replica groups (diloco; default 2)."),
    fragments: int | None = typer.Option(None, help="Fragments synchronised in turn (diloco; default 1)."),
    overlap_steps: int | None = typer.Option(None, help="Inner steps an all-reduce overlaps (diloco; 0)."),
    inner_steps: int | None = typer.Option(None, help="Inner steps H between syncs (diloco; 4 F)."),
    json_path: Path | None = typer.Option(None, "--json", help='Write {"steps": [...]} here.'),
    png: Path | None = typer.Option(
        None, help="Write a picture here (trees, holdings per step, or the timeline)."
    ),
    animate: Path | None = typer.Option(
        None, help="Write a GIF stepping through a collective's chunks here."
    ),
) -> None:
    """Show a schedule step by step: per rank what it sends, receives and holds; trees; pipeline timelines."""
    from ringtree.show import ring_attention
    from ringtree.show.alltoall import SHOWS as A2A_SHOWS
    from ringtree.show.moe import MOE_SHOWS
    from ringtree.show.pipeline import PIPELINES
    from ringtree.show.zero import ZERO_SHOWS

    for path, option in ((json_path, "--json"), (png, "--png"), (animate, "--animate")):
        check_output(path, option)
    try:
        _check_outputs(png, animate)
        if algorithm not in MOE_SHOWS and experts is not None:
            raise ValueError(f"--experts does not apply to {algorithm}; leave it out")
        outer = {"--replicas": replicas, "--fragments": fragments, "--overlap-steps": overlap_steps,
                 "--inner-steps": inner_steps}  # fmt: skip
        given = [name for name, value in outer.items() if value is not None]
        if algorithm != "diloco" and given:
            raise ValueError(f"{given[0]} applies to `ringtree show diloco`, not {algorithm}; leave it out")
        if algorithm == "diloco":
            from ringtree.cli.show_diloco import show_diloco

            _refuse("diloco", collective=collective, ranks=ranks, nodes=nodes, bytes=nbytes, root=root,
                    link=link, intra=intra, stages=stages, micro_batches=micro_batches,
                    virtual_stages=virtual_stages, animate=animate)  # fmt: skip
            show_diloco(replicas, fragments, overlap_steps, inner_steps, json_path, png)
            return
        if algorithm == ring_attention.NAME:
            _refuse("ring attention", collective=collective, nodes=nodes, bytes=nbytes, root=root, link=link,
                    intra=intra, stages=stages, micro_batches=micro_batches, virtual_stages=virtual_stages,
                    animate=animate)  # fmt: skip
            _show_ring_attention(4 if ranks is None else ranks, json_path, png)
        elif algorithm in MOE_SHOWS:
            _refuse("moe-dispatch", collective=collective, nodes=nodes, bytes=nbytes, root=root, link=link,
                    intra=intra, stages=stages, micro_batches=micro_batches, virtual_stages=virtual_stages,
                    animate=animate)  # fmt: skip
            _show_moe(4 if ranks is None else ranks, 8 if experts is None else experts, json_path, png)
        elif algorithm in ZERO_SHOWS:
            _refuse("a ZeRO step", collective=collective, nodes=nodes, bytes=nbytes, root=root, link=link,
                    intra=intra, stages=stages, micro_batches=micro_batches, animate=animate)  # fmt: skip
            _show_zero(int(algorithm[-1]), 4 if ranks is None else ranks, json_path, png)
        elif algorithm in PIPELINES:
            _refuse("a pipeline", collective=collective, ranks=ranks, nodes=nodes, bytes=nbytes, root=root,
                    link=link, intra=intra, animate=animate)  # fmt: skip
            if virtual_stages is not None and algorithm != "interleaved":
                raise ValueError(
                    f"--virtual-stages {virtual_stages} cuts each stage into chunks for --schedule "
                    f"interleaved, not {algorithm}; drop it or show interleaved"
                )
            _show_pipeline(
                algorithm,
                (4 if stages is None else stages, 8 if micro_batches is None else micro_batches),
                (2 if virtual_stages is None else virtual_stages) if algorithm == "interleaved" else 1,
                json_path,
                png,
            )
        elif algorithm in A2A_SHOWS or (collective or "").replace("-", "_") == "all_to_all":
            if collective is not None and collective.replace("-", "_") != "all_to_all":
                raise ValueError(
                    f"{algorithm} is an all-to-all algorithm, not {collective}; drop --collective"
                )
            _refuse("an all-to-all", root=root, stages=stages, micro_batches=micro_batches,
                    virtual_stages=virtual_stages, animate=animate)  # fmt: skip
            _show_all_to_all(algorithm, ranks, nodes, nbytes, (link or "eth-10g", intra), json_path, png)
        else:
            _refuse("a collective", stages=stages, micro_batches=micro_batches, virtual_stages=virtual_stages)
            _show_collective(
                _collective_request(algorithm, collective, ranks, nodes, nbytes, root),
                (link or "eth-10g", intra),
                (json_path, png, animate),
            )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _show_all_to_all(
    name: str,
    ranks: int | None,
    nodes: int | None,
    nbytes: str | None,
    links: tuple[str, str | None],
    json_path: Path | None,
    png: Path | None,
) -> None:
    """Who sends which block to whom at each step, what each rank holds, and the alpha-beta cost."""
    from ringtree.show import alltoall as a2a
    from ringtree.show.cost import make_cluster
    from ringtree.show.text import seconds, size
    from ringtree.units import parse_size

    names = {**a2a.SHOWS, "hierarchical": "hierarchical"}
    if name not in names:
        raise ValueError(f"unknown all_to_all algorithm {name!r}; choose one of {', '.join(a2a.SHOWS)}")
    algorithm, p, n = names[name], 4 if ranks is None else ranks, nodes or 1
    if not 1 <= p <= 64:
        raise ValueError(f"--ranks {p}: show an all-to-all on 1 to 64 ranks")
    if png is not None and p > FULL_RANKS:
        raise ValueError(f"--png draws every block: give --ranks {FULL_RANKS} or fewer (got {p})")
    total = parse_size(nbytes or "4M")
    if total < 4 * p:
        raise ValueError(f"--bytes {nbytes} is too small to show: give at least 4 bytes per rank and block")
    w = a2a.walk(algorithm, p, total, n)
    charges = a2a.cost(w, make_cluster(p, n, *links))
    where = f"{n} nodes of {p // n}" if n > 1 else "1 node"
    console.print(
        f"ringtree show {name} (all_to_all): {p} ranks on {where}, {size(total)} of float32 per rank "
        f"in {p} blocks of {size(total // 4 // p * 4)}",
        highlight=False,
    )
    shown = _shown_ranks(p)
    table = Table(show_lines=True)
    table.add_column("step", justify="right")
    for r in shown:
        table.add_column(f"rank {r}", overflow="fold")
    for t, step in enumerate(w.steps):
        cells = ["\n".join([*a2a.moves_text(step[r]), "holds " + a2a.holds_text(step[r], p)]) for r in shown]
        table.add_row(str(t), *cells)
    console.print(table)
    console.print(
        "→r: i→j ...: send rank r blocks i→j (rank i's block for rank j) in one message; ←r: receive them; "
        "holds: the sources whose block for this rank it has, and blocks it still has to pass on",
        highlight=False,
    )
    console.print(
        f"\nsteps: {w.schedule.num_steps}   checked: every block reaches its destination, each rank "
        "receives it once (ringtree.schedules.verify)",
        highlight=False,
        soft_wrap=True,
    )
    total_s = sum(c.seconds for c in charges)
    console.print(
        f"cost (alpha-beta): textbook T = {a2a.TEXTBOOK[algorithm]}", highlight=False, soft_wrap=True
    )
    terms = " + ".join(
        f"{c.messages}·α + {size(c.nbytes)}·β ({c.link.name}: α = {seconds(c.link.alpha_s)}, "
        f"β = 1/({c.link.bandwidth_Bps / 1e9:.3g} GB/s))"
        for c in charges
    )
    console.print(f"  this schedule T = {terms or '0'} = {seconds(total_s)}", highlight=False, soft_wrap=True)
    if json_path is not None:
        doc = {
            "collective": "all_to_all",
            "algorithm": algorithm,
            "ranks": p,
            "nodes": n,
            "bytes": total,
            "itemsize": w.itemsize,
            "alpha_beta_s": total_s,
            "textbook": a2a.TEXTBOOK[algorithm],
            "steps": a2a.to_json(w),
        }
        write_json(json_path, doc)
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        from ringtree.plots import plot_all_to_all

        title = f"{name} all-to-all: {p} ranks on {where}"
        plot_all_to_all(a2a.frames(w), p, png, title)
        console.print(f"wrote {png}", highlight=False)


def _show_zero(zero: int, p: int, json_path: Path | None, png: Path | None) -> None:
    """Which rank holds which shard of parameters, gradients and optimizer states, step by step."""
    from ringtree.show.zero import cell, ddp_units, plot_zero, zero_steps

    if not 1 <= p <= 64:
        raise ValueError(f"--ranks {p}: show a ZeRO step on 1 to 64 ranks")
    steps = zero_steps(zero)
    layers = len(steps[0].holds["params"])
    shown = _shown_ranks(p)
    console.print(
        f"ringtree show zero{zero}: one training step of a {layers}-layer model on {p} data-parallel ranks "
        f"(rank r holds shard r, 1/{p} of a layer)",
        highlight=False,
    )
    table = Table(show_lines=False)
    for name in ("step", "action", "communication", *[f"rank {r}" for r in shown], "state / DDP's"):
        table.add_column(name, overflow="fold")
    for k, s in enumerate(steps):
        share = f"{s.units(p) / ddp_units(layers):.2f}"
        table.add_row(str(k), s.action, s.comm, *[cell(s.holds, r) for r in shown], share)
    console.print(table)
    console.print(
        "P params, G grads, O optimizer states (AdamW's two moments); one character per layer: "
        "W whole, a digit r only rank r's shard, . nothing. State per rank in units of DDP's "
        "(params + grads + 2 moments, whole, on every rank).",
        highlight=False,
    )
    if json_path is not None:
        rows = [{"action": s.action, "communication": s.comm, "holds": s.holds} for s in steps]
        write_json(json_path, {"zero": zero, "ranks": p, "layers": layers, "steps": rows})
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        plot_zero(steps, zero, p, png)
        console.print(f"wrote {png}", highlight=False)


def _show_moe(p: int, experts: int, json_path: Path | None, png: Path | None) -> None:
    """One MoE layer's dispatch over p expert-parallel ranks: the tokens, counts and all-to-alls."""
    from ringtree.show.moe import TOKENS, TOP_K, dispatch_steps, plot_dispatch

    if not 1 <= p <= 16:
        raise ValueError(f"--ranks {p}: show the dispatch on 1 to 16 ranks")
    if experts < 1:
        raise ValueError(f"--experts must be at least 1, got {experts}")
    steps = dispatch_steps(p, experts)
    console.print(
        f"ringtree show moe-dispatch: one MoE layer on {p} expert-parallel ranks, {experts} experts "
        f"(rank r holds the {experts // p} from e{experts // p}r), {TOKENS} tokens a rank (rRtT: rank R's "
        f"token T), top-{TOP_K}",
        highlight=False,
    )
    table = Table(show_lines=True)
    for name in ("step", "action", "communication", *[f"rank {r}" for r in _shown_ranks(p)]):
        table.add_column(name, overflow="fold")
    for k, s in enumerate(steps):
        table.add_row(str(k), s.action, s.comm or "-", *[s.ranks[r] for r in _shown_ranks(p)])
    console.print(table)
    if json_path is not None:
        rows = [
            {"action": s.action, "communication": s.comm, "ranks": s.ranks, "sends": s.sends} for s in steps
        ]
        write_json(
            json_path, {"ranks": p, "experts": experts, "tokens": TOKENS, "top_k": TOP_K, "steps": rows}
        )
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        plot_dispatch(steps, p, experts, str(png))
        console.print(f"wrote {png}", highlight=False)


def _show_ring_attention(p: int, json_path: Path | None, png: Path | None) -> None:
    """Which K/V block each context-parallel rank holds at each step; the blocks computed and skipped."""
    from ringtree.schedules.ring_attention import chunks, ring_steps
    from ringtree.show.ring_attention import cell, communication, plot_ring_attention, report

    if not 1 <= p <= 64:
        raise ValueError(f"--ranks {p}: show ring attention on 1 to 64 ranks")
    shown = _shown_ranks(p)
    held = "; ".join(f"rank {r}: {','.join(map(str, chunks(r, p, True)))}" for r in shown)
    console.print(
        f"ringtree show ring-attention: causal attention over {2 * p} chunks of a sequence on {p} "
        f"context-parallel ranks, head-tail (rank r holds chunks r and {2 * p - 1}-r: {held})",
        highlight=False,
    )
    table = Table(show_lines=True)
    for name in ("step", "communication", *[f"rank {r}" for r in shown]):
        table.add_column(name, overflow="fold")
    for k, row in enumerate(ring_steps(p)):
        table.add_row(str(k), communication(k, p), *[cell(row[r], p, True) for r in shown])
    console.print(table)
    data = report(p)
    console.print(
        f"qi-kj: query chunk i against key chunk j, whole (full), with the causal mask, or skipped (its "
        f"keys all follow its queries). Work per rank (chunk products; causal = 1/2): {data['work'][0]:g} "
        f"on every rank. Backward: the same {p - 1} K/V shifts and {p} dK/dV shifts riding with them.",
        highlight=False,
    )
    if json_path is not None:
        write_json(json_path, data)
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        plot_ring_attention(p, png)
        console.print(f"wrote {png}", highlight=False)


def _refuse(what: str, **given: Any) -> None:
    """An option that does not apply would be silently ignored: refuse it instead."""
    wrong = [name.replace("_", "-") for name, value in given.items() if value is not None]
    if wrong:
        raise ValueError(f"--{wrong[0]} does not apply to {what}; leave it out")


def _check_outputs(png: Path | None, animate: Path | None) -> None:
    if png is not None and png.suffix.lower() != ".png":
        raise ValueError(f"--png {png}: name a .png file")
    if animate is not None:
        if animate.suffix.lower() != ".gif":
            raise ValueError(f"--animate {animate}: name a .gif file")
        try:
            import PIL  # noqa: F401  (matplotlib's PillowWriter needs it)
        except ImportError:
            raise ValueError("--animate needs Pillow: pip install pillow") from None


def _collective_request(
    algorithm: str,
    collective: str | None,
    ranks: int | None,
    nodes: int | None,
    nbytes: str | None,
    root: int | None,
) -> dict[str, Any]:
    """The checked collective, algorithm, ranks, nodes, bytes and root."""
    from ringtree.schedules.registry import COLLECTIVES, GENERATORS
    from ringtree.show.pipeline import PIPELINES
    from ringtree.units import parse_size

    name = (collective or "all_reduce").replace("-", "_")  # all-reduce and all_reduce alike
    if name not in GENERATORS:
        names = ", ".join(c.replace("_", "-") for c in COLLECTIVES)
        raise ValueError(f"unknown --collective {collective!r}; choose one of {names}")
    if algorithm not in GENERATORS[name]:
        raise ValueError(
            f"unknown {name} algorithm {algorithm!r}; choose one of {', '.join(GENERATORS[name])} "
            f"(or a pipeline: {', '.join(PIPELINES)})"
        )
    if root is not None and name not in ("broadcast", "reduce"):
        raise ValueError(f"--root applies to broadcast and reduce, not {name}; leave it out")
    p = 4 if ranks is None else ranks
    if root is not None and not 0 <= root < p:
        raise ValueError(f"--root {root} is not one of the ranks 0..{p - 1}")
    size = parse_size(nbytes or "4M")
    if size < 4 * p:
        raise ValueError(
            f"--bytes {nbytes} is too small to show: give at least 4 bytes (one float32) per rank"
        )
    return {
        "collective": name,
        "algorithm": algorithm,
        "p": p,
        "nodes": nodes or 1,
        "nbytes": size,
        "root": root or 0,
    }


def _has_trees(q: dict[str, Any]) -> bool:
    from ringtree.show.trees import TREE_ALGORITHMS

    return (q["collective"], q["algorithm"]) in TREE_ALGORITHMS


def _shown_ranks(p: int) -> list[int]:
    return list(range(p)) if p <= FULL_RANKS else [0, 1, p - 1]


def _shown_steps(n: int) -> list[int | None]:
    """Step indices to print, None where steps are left out."""
    if n <= FULL_STEPS:
        return list(range(n))
    return [*range(EDGE_STEPS), None, *range(n - EDGE_STEPS, n)]


def _show_collective(
    q: dict[str, Any], links: tuple[str, str | None], outputs: tuple[Path | None, ...]
) -> None:
    from ringtree.show.cost import cost, make_cluster
    from ringtree.show.steps import walk

    p = q["p"]
    json_path, png, animate = outputs
    holdings_picture = animate is not None or (png is not None and not _has_trees(q))
    if holdings_picture and p > FULL_RANKS:
        raise ValueError(
            f"pictures of holdings need --ranks {FULL_RANKS} or fewer (got {p}); trees draw for any count"
        )
    w = walk(
        q["collective"], q["algorithm"], p, q["nbytes"], q["nodes"], q["root"], tracked=set(_shown_ranks(p))
    )
    cluster = make_cluster(p, q["nodes"], *links)
    c = cost(w, cluster)
    _print_steps(w, q["nodes"])
    _print_trees(q, w)
    _print_summary(w, c)
    if json_path is not None:
        write_json(json_path, _collective_json(w, q, c))
        console.print(f"wrote {json_path}", highlight=False)
    _collective_pictures(q, w, png, animate)


def _title(w: Any, nodes: int) -> str:
    from ringtree.show.text import size

    chunk = size((w.cuts[1] - w.cuts[0]) * w.itemsize) if w.num_chunks else "0B"
    where = f"{nodes} nodes of {w.p // nodes}" if nodes > 1 else "1 node"
    return (
        f"ringtree show {w.schedule.algorithm} ({w.schedule.collective}): {w.p} ranks on {where}, "
        f"{size(w.nbytes)} of float32 in {w.num_chunks} chunk{'s' if w.num_chunks > 1 else ''} (c0 = {chunk})"
    )


def _print_steps(w: Any, nodes: int) -> None:
    from ringtree.show.text import holds_text, moves_text, size

    shown = _shown_ranks(w.p)
    console.print(_title(w, nodes), highlight=False)
    table = Table(show_lines=True)
    table.add_column("step", justify="right")
    table.add_column("kind", overflow="fold")
    for r in shown:
        table.add_column(f"rank {r}", overflow="fold")  # a narrow terminal folds, never hides
    summarised = len(shown) < w.p
    if summarised:
        table.add_column(f"all {w.p} ranks", overflow="fold")
    table.add_row(
        "start", "", *[holds_text(w.initial[r], {}, w.p) for r in shown], *([""] if summarised else [])
    )
    for t in _shown_steps(w.schedule.num_steps):
        if t is None:
            table.add_row("…", "", *["…"] * len(shown), *(["…"] if summarised else []))
            continue
        v = w.steps[t]
        cells = [
            "\n".join([*moves_text(*w.moves(r, t)), "holds " + holds_text(v.holds[r], w.initial[r], w.p)])
            for r in shown
        ]
        extra = (
            f"{w.messages(t)} messages, busiest port {size(w.busiest_bytes(t))}\n"
            f"complete chunks per rank: {v.done_min}..{v.done_max}"
        )
        table.add_row(str(t), w.kind(t), *cells, *([extra] if summarised else []))
    console.print(table)
    console.print(
        "→r cK: send chunk K to rank r; ←r cK (+): receive it from rank r and add it in (without (+): "
        "copy it); holds cK={a,b}: chunk K holds the sum of ranks a and b's inputs, Σ of all ranks' "
        "(chunks unchanged since the start left out)",
        highlight=False,
    )


def _print_trees(q: dict[str, Any], w: Any) -> None:
    from ringtree.show.trees import ascii_lines, interior_in_all, role, trees_of

    shown = trees_of(q["collective"], q["algorithm"], w.p, q["root"])
    if not shown:
        return
    for k, s in enumerate(shown, 1):
        console.print(f"\ntree {k} (carries {s.carries}), root {s.tree.root}:", highlight=False)
        if w.p <= DRAW_TREE_RANKS:
            console.print("\n".join(ascii_lines(s.tree)), highlight=False)
    console.print("each rank's role:", highlight=False)
    table = Table()
    table.add_column("rank", justify="right")
    for k in range(len(shown)):
        table.add_column(f"tree {k + 1}")
    for r in _shown_ranks(w.p) if w.p > DRAW_TREE_RANKS else range(w.p):
        table.add_row(str(r), *[_role_text(s.tree, r, role(s.tree, r)) for s in shown])
    console.print(table)
    if len(shown) > 1:
        both = sorted(interior_in_all(shown))
        console.print(
            "no rank is interior in both trees: each forwards data for at most one"
            if not both
            else f"ranks interior in both trees: {both}",
            highlight=False,
        )


def _role_text(tree: Any, r: int, kind: str) -> str:
    up = tree.parent[r]
    kids = tree.children[r]
    parts = (
        [kind]
        + ([f"parent {up}"] if up >= 0 else [])
        + ([f"children {','.join(map(str, kids))}"] if kids else [])
    )
    return ", ".join(parts)


def _print_summary(w: Any, c: Any) -> None:
    from ringtree.schedules.verify import dry_run
    from ringtree.show.text import seconds, size

    sent = [w.bytes_sent(r) for r in range(w.p)]
    lo, hi = min(sent), max(sent)
    per_rank = (
        f"{size(lo)} each" if lo == hi else f"{size(lo)} to {size(hi)} (rank {sent.index(hi)} the most)"
    )
    console.print(
        f"\nsteps: {w.schedule.num_steps}   bytes sent per rank: {per_rank} "
        f"(= {hi / max(w.nbytes, 1):.3g} n, n = {size(w.nbytes)})",
        highlight=False,
        soft_wrap=True,
    )
    dry_run(w.schedule, w.root)
    console.print(
        f"checked: every rank ends with what {w.schedule.collective} promises (ringtree.schedules.verify)",
        highlight=False,
        soft_wrap=True,
    )
    links = ", ".join(
        f"{lv.link.name}: α = {seconds(lv.link.alpha_s)}, β = 1/({lv.link.bandwidth_Bps / 1e9:.3g} GB/s)"
        for lv in c.levels
    )
    console.print(f"cost (alpha-beta; {links}):", highlight=False, soft_wrap=True)
    if c.textbook:
        console.print(f"  textbook      T = {c.textbook}", highlight=False, soft_wrap=True)
    sub = "" if len(c.levels) == 1 else "_{}"
    alpha = " + ".join(f"{lv.steps}·α{sub.format(lv.link.name)}" for lv in c.levels)
    beta = " + ".join(f"{size(lv.nbytes)}·β{sub.format(lv.link.name)}" for lv in c.levels)
    terms = " + ".join([seconds(lv.alpha_s) for lv in c.levels] + [seconds(lv.beta_s) for lv in c.levels])
    console.print(
        f"  this schedule T = {alpha} + {beta} = {terms} = {seconds(c.total_s)}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        "                (each step costs its slowest message: α + its port's bytes·β)",
        highlight=False,
        soft_wrap=True,
    )
    if c.simulated_s is not None:
        console.print(
            f"  simulator     T = {seconds(c.simulated_s)} "
            f"({c.method}, ringtree.sim: adds γ and link sharing)",
            highlight=False,
            soft_wrap=True,
        )


def _collective_json(w: Any, q: dict[str, Any], c: Any) -> dict[str, Any]:
    from ringtree.show.steps import to_json

    return {
        "collective": q["collective"],
        "algorithm": q["algorithm"],
        "ranks": w.p,
        "nodes": q["nodes"],
        "bytes": w.nbytes,
        "itemsize": w.itemsize,
        "chunks": [[a * w.itemsize, b * w.itemsize] for a, b in zip(w.cuts, w.cuts[1:], strict=False)],
        "holds_tracked_for": _shown_ranks(w.p),
        "bytes_sent_per_rank": [w.bytes_sent(r) for r in range(w.p)],
        "alpha_beta_s": c.total_s,
        "simulated_s": c.simulated_s,
        "steps": to_json(w),
    }


def _collective_pictures(q: dict[str, Any], w: Any, png: Path | None, animate: Path | None) -> None:
    from ringtree import plots
    from ringtree.show.steps import holdings_frames
    from ringtree.show.trees import positions, trees_of

    title = _title(w, q["nodes"]).removeprefix("ringtree show ")
    shown = trees_of(q["collective"], q["algorithm"], w.p, q["root"])
    if png is not None and shown:
        data = [
            {
                "title": f"tree {k} ({s.carries}), root {s.tree.root}",
                "parent": s.tree.parent,
                "x": positions(s.tree),
                "depth": s.tree.depths(),
            }
            for k, s in enumerate(shown, 1)
        ]
        plots.plot_trees(data, png, title + ("\nfilled: interior, hollow: leaf" if len(shown) > 1 else ""))
    elif png is not None:  # one panel per step, at most 16 evenly spread
        frames = holdings_frames(w)
        picks = (
            frames if len(frames) <= 16 else [frames[round(k * (len(frames) - 1) / 15)] for k in range(16)]
        )
        plots.plot_holdings(picks, w.p, png, title, w.p // q["nodes"] if q["nodes"] > 1 else None)
    if png is not None:
        console.print(f"wrote {png}", highlight=False)
    if animate is not None:
        plots.animate_holdings(holdings_frames(w), w.p, animate, title)
        console.print(f"wrote {animate}", highlight=False)


def _show_pipeline(
    name: str, shape: tuple[int, int], v: int, json_path: Path | None, png: Path | None
) -> None:
    from ringtree.show.pipeline import timeline

    t = timeline(name, *shape, v)
    _print_timeline(t)
    if json_path is not None:
        write_json(json_path, _pipeline_json(t))
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        from ringtree.plots import plot_gantt
        from ringtree.show.pipeline import gantt_spans

        asynchronous = name.startswith("pipedream")
        plot_gantt(
            gantt_spans(t, asynchronous),
            png,
            _pipeline_title(t) + (", labels micro-batch/weight version" if asynchronous else ""),
        )
        console.print(f"wrote {png}", highlight=False)


def _pipeline_title(t: Any) -> str:
    s = t.schedule
    chunks = f", {s.virtual_stages} chunks a stage" if s.virtual_stages > 1 else ""
    chunks += ", a V: stage j holds chunks j and 2p-1-j" if s.placement == "v" else ""
    unit = "a chunk's forward" if s.virtual_stages > 1 else "forward"
    backward = "B 1, W 1" if s.splits_backward else "backward 2"
    return (
        f"{s.name}: {s.stages} stages, {s.micro_batches} micro-batches{chunks} "
        f"({unit} 1 slot = 1 ms, {backward}, transfers free)"
    )


def _print_timeline(t: Any) -> None:
    """The timeline as text (one line per stage, never wrapped), then the per-stage figures."""
    from rich.text import Text

    s = t.schedule
    width = len(str(s.micro_batches - 1)) + 1 + (2 if s.virtual_stages > 1 else 0)
    console.print("ringtree show " + _pipeline_title(t).replace(" = 1 ms", ""), highlight=False)
    styles = {"forward": "blue", "backward": "yellow", "weight": "green", "idle": "dim"}
    for j, row in enumerate(t.slots):
        line = Text(f"stage {j}  ")
        for slot in row:
            chunk = f".{slot.chunk}" if s.virtual_stages > 1 else ""
            label = "·" * width if slot.op == "idle" else f"{slot.op[0].upper()}{slot.micro_batch}{chunk}"
            line.append(label.ljust(width), style=styles[slot.op])
        console.print(line, soft_wrap=True)
    legend = (
        "F forward, B input gradient, W weight gradient (one slot each), · idle"
        if s.splits_backward
        else "F forward, B backward (two slots), · idle"
    )
    console.print(
        legend + ("; F3.1: micro-batch 3, chunk 1" if s.virtual_stages > 1 else ""), highlight=False
    )
    table = Table()
    for name in ("stage", "busy", "activations in flight (peak)", "weight versions (peak)"):
        table.add_column(name, justify="right")
    for j, row in enumerate(t.slots):
        busy = sum(slot.op != "idle" for slot in row) / len(row)
        table.add_row(str(j), f"{busy:.0%}", str(t.in_flight()[j]), str(t.versions()[j]))
    console.print(table)
    p, m, v = s.stages, s.micro_batches, s.virtual_stages
    formula = (
        f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}" if v == 1 else f"(p-1)/(v m+p-1) = {p - 1}/{v * m + p - 1}"
    )
    if s.splits_backward:
        from ringtree.sim.training.pipeline import FORMULAS

        formula = f"published idle per stage {FORMULAS[s.name]}, as a fraction"
    console.print(
        f"bubble fraction: {t.bubble_fraction:.3f} of stage time idle (replayed); "
        f"{formula} = {t.theoretical_bubble_fraction:.3f}",
        highlight=False,
    )
    if s.name.startswith("pipedream"):
        _print_versions(t)


def _print_versions(t: Any) -> None:
    console.print("weight version each forward uses (its backward uses the same, stashed):", highlight=False)
    table = Table()
    table.add_column("stage")
    for i in range(t.schedule.micro_batches):
        table.add_column(f"mb {i}", justify="right")
    table.add_column("staleness (steps)")
    stale = t.staleness()
    for j, versions in enumerate(t.forward_versions()):
        table.add_row(str(j), *map(str, versions), f"{max(stale[j], default=0)}")
    console.print(table)


def _pipeline_json(t: Any) -> dict[str, Any]:
    from ringtree.show.pipeline import to_json

    s = t.schedule
    return {
        "schedule": s.name,
        "stages": s.stages,
        "micro_batches": s.micro_batches,
        "virtual_stages": s.virtual_stages,
        "placement": s.placement,
        "splits_backward": s.splits_backward,
        "bubble_fraction": t.bubble_fraction,
        "theoretical_bubble_fraction": t.theoretical_bubble_fraction,
        "activations_in_flight": t.in_flight(),
        "weight_versions": t.versions(),
        "forward_versions": t.forward_versions(),
        "steps": to_json(t),
    }
