"""`ringtree show`: step tables on known small cases, holdings vs a numeric replay, pictures, JSON, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ringtree.cli import app
from ringtree.schedules import OpKind
from ringtree.schedules.pipeline import theoretical_bubble_fraction
from ringtree.show import cost, make_cluster, timeline, trees_of, walk
from ringtree.show.steps import holdings_frames, members
from ringtree.show.text import contributors, holds_text
from ringtree.show.trees import ascii_lines, interior_in_all, positions, role
from ringtree.sim.network.closed_form import estimate
from ringtree.sim.network.hardware import Cluster, Link

runner = CliRunner()
N = 4 << 20  # bytes


def run(*args: str) -> tuple[int, str]:
    """Exit code and output with rich's wrapping and boxes undone (one space between words)."""
    result = runner.invoke(app, ["show", *args])
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


# --- the ring on 4 ranks, exactly -------------------------------------------------------------


def test_ring_on_4_ranks_takes_2p_minus_2_steps_of_one_pth_each() -> None:
    w = walk("all_reduce", "ring", 4, N)
    assert w.schedule.num_steps == 6
    assert w.num_chunks == 4
    for t in range(6):
        for r in range(4):
            sends, recvs = w.moves(r, t)
            assert [(m.peer, m.nbytes) for m in sends] == [((r + 1) % 4, N // 4)]
            assert [(m.peer, m.nbytes, m.reduce) for m in recvs] == [((r - 1) % 4, N // 4, t < 3)]
        assert w.kind(t) == ("reduce" if t < 3 else "copy")
    assert [w.bytes_sent(r) for r in range(4)] == [6 * N // 4] * 4


def test_ring_holdings_build_partial_sums_then_every_rank_holds_every_chunk_reduced() -> None:
    w = walk("all_reduce", "ring", 4, N)
    # Step 0: rank 3 sends block 2 to rank 0, which adds it to its own: the partial sum of 0 and 3.
    assert {c: members(m) for c, m in w.steps[0].holds[0].items()} == {0: [0], 1: [0], 2: [0, 3], 3: [0]}
    # After the reduce-scatter (step 2) rank r holds block r+1 complete, as the seeds' tables show.
    assert [[c for c, m in w.steps[2].holds[r].items() if m == 0b1111] for r in range(4)] == [
        [0],
        [1],
        [2],
        [3],
    ]
    assert [(v.done_min, v.done_max) for v in w.steps] == [(0, 0), (0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    for r in range(4):
        assert w.final(r) == {c: 0b1111 for c in range(4)}
    frames = holdings_frames(w)  # what --png and --animate draw
    assert frames[0]["held"] == [[1] * 4] * 4
    assert frames[1]["held"][0] == [1, 1, 2, 1] and frames[1]["received"] == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert frames[-1]["held"] == [[4] * 4] * 4


@pytest.mark.parametrize(
    ("collective", "algorithm", "p"),
    [
        ("all_reduce", "ring", 5),
        ("all_reduce", "halving_doubling", 6),
        ("all_reduce", "double_tree", 7),
        ("all_reduce", "hierarchical", 4),
        ("reduce_scatter", "bfb", 4),
        ("all_gather", "ring", 3),
        ("broadcast", "tree", 5),
        ("reduce", "ring", 4),
    ],
)
def test_holdings_match_a_numeric_replay(collective: str, algorithm: str, p: int) -> None:
    """Rank r's input is 2**r in every element; summing the real numbers along the schedule must give,
    for every rank, chunk and step, exactly the contributor mask the walk reports."""
    w = walk(collective, algorithm, p, 4 * 64, nodes=2 if algorithm == "hierarchical" else 1)
    values = [dict(w.initial[r]) for r in range(p)]
    for v in w.steps:
        sent = {
            (r, m.peer, m.chunks): [values[r].get(c, 0) for c in m.chunks]
            for r in range(p)
            for m in w.moves(r, v.t)[0]
        }
        for r in range(p):
            for m in w.moves(r, v.t)[1]:
                for c, x in zip(m.chunks, sent[(m.peer, r, m.chunks)], strict=True):
                    values[r][c] = values[r].get(c, 0) + x if m.reduce else x
        assert values == [v.holds[r] for r in range(p)]


def test_reduce_scatter_ends_with_one_complete_block_per_rank() -> None:
    w = walk("reduce_scatter", "ring", 4, N)
    assert w.schedule.num_steps == 3
    assert (w.steps[-1].done_min, w.steps[-1].done_max) == (1, 1)
    assert [[c for c, m in w.final(r).items() if m == 0b1111] for r in range(4)] == [[0], [1], [2], [3]]


def test_texts() -> None:
    assert contributors(0b1111, 4) == "Σ"
    assert contributors(0b1011, 8) == "{0,1,3}"
    assert contributors(0b10111, 8) == "{0..2,4}"
    initial = {c: 1 for c in range(4)}
    assert holds_text(initial, initial, 4) == "own data"
    assert holds_text({0: 15, 1: 15, 2: 3, 3: 1}, initial, 4) == "c0,c1=Σ c2={0,1}"
    assert holds_text({}, {}, 4) == "nothing"


# --- trees ------------------------------------------------------------------------------------


def test_double_tree_on_8_ranks_has_no_rank_interior_in_both_trees() -> None:
    shown = trees_of("all_reduce", "double_tree", 8)
    assert len(shown) == 2
    assert interior_in_all(shown) == set()
    for r in range(8):
        assert "leaf" in {role(s.tree, r) for s in shown}
    code, out = run("double_tree", "--ranks", "8")
    assert code == 0, out
    assert "no rank is interior in both trees" in out


def test_tree_is_drawn_in_order() -> None:
    tree = trees_of("all_reduce", "tree", 7)[0].tree
    assert positions(tree) == {r: r for r in range(7)}
    assert ascii_lines(tree) == [
        "      3",
        "    /   \\",
        "  1       5",
        " / \\     / \\",
        "0   2   4   6",
    ]


def test_rooted_broadcast_tree_is_shown() -> None:
    (shown,) = trees_of("broadcast", "tree", 6, root=2)
    assert shown.tree.root == 2
    assert sorted(positions(shown.tree)) == list(range(6))


# --- costs ------------------------------------------------------------------------------------


def test_ring_cost_fills_in_the_textbook_formula_and_agrees_with_the_simulator() -> None:
    link = Link("test", 10e-6, 1e9)
    p = 4
    w = walk("all_reduce", "ring", p, N)
    c = cost(w, Cluster(1, p, link, link))
    (level,) = c.levels
    assert level.steps == 2 * (p - 1)
    assert level.nbytes == pytest.approx(2 * (p - 1) / p * N)
    assert c.total_s == pytest.approx(2 * (p - 1) * 10e-6 + 2 * (p - 1) / p * N / 1e9)
    assert c.textbook == "2(p-1)·α + 2(p-1)/p·n·β"
    gamma = (p - 1) / p * N * Cluster.gamma
    assert c.simulated_s == pytest.approx(c.total_s + gamma, rel=1e-6)
    assert estimate("ring", Cluster(1, p, link, link), N) == pytest.approx(c.simulated_s, rel=1e-6)


def test_cost_charges_steps_to_their_link_across_nodes() -> None:
    w = walk("all_reduce", "hierarchical", 8, N, nodes=2)
    c = cost(w, make_cluster(8, 2, "eth-10g", "nvlink-a100"))
    assert [(lv.link.name, lv.steps) for lv in c.levels] == [("nvlink-a100", 6), ("eth-10g", 2)]
    with pytest.raises(ValueError, match="--intra"):
        make_cluster(4, 1, "eth-10g", "nvlink-a100")


# --- pipelines --------------------------------------------------------------------------------


def test_pipeline_timelines() -> None:
    for name in ("gpipe", "1f1b"):
        t = timeline(name, 4, 8)
        assert t.bubble_fraction == pytest.approx(theoretical_bubble_fraction(4, 8))
        for row in t.slots:
            assert sum(s.op == "forward" for s in row) == 8
            assert sum(s.op == "backward" for s in row) == 16
    assert timeline("gpipe", 4, 8).in_flight() == [8, 8, 8, 8]
    assert timeline("1f1b", 4, 8).in_flight() == [4, 3, 2, 1]
    pd = timeline("pipedream", 3, 5)
    assert pd.versions() == [3, 2, 1]
    assert pd.forward_versions() == [[0, 0, 0, 1, 2], [0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_pipeline_command_prints_the_bubble_and_versions(tmp_path: Path) -> None:
    code, out = run("pipedream", "--stages", "3", "--micro-batches", "4", "--json", str(tmp_path / "p.json"))
    assert code == 0, out
    assert "(p-1)/(m+p-1) = 2/6 = 0.333" in out
    assert "weight version each forward uses" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["activations_in_flight"] == [3, 2, 1]
    first = data["steps"][0]["stages"]
    assert first[0] == {"stage": 0, "op": "forward", "micro_batch": 0, "version": 0}
    assert first[1] == {"stage": 1, "op": "idle"}


# --- the command: JSON, pictures, errors ------------------------------------------------------


def test_json_has_one_entry_per_step_with_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "ring.json"
    code, text = run("ring", "--ranks", "4", "--bytes", "4M", "--json", str(out))
    assert code == 0, text
    assert "steps: 6" in text
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 6
    assert data["bytes_sent_per_rank"] == [6 << 20] * 4
    step0 = data["steps"][0]
    assert step0["step"] == 0 and step0["kind"] == "reduce"
    assert [r["rank"] for r in step0["ranks"]] == [0, 1, 2, 3]
    assert step0["ranks"][0]["sends"] == [{"to": 1, "chunks": [3], "bytes": 1 << 20}]
    assert step0["ranks"][0]["recvs"] == [{"from": 3, "chunks": [2], "bytes": 1 << 20, "reduce": True}]
    assert step0["ranks"][0]["holds"] == {"0": [0], "1": [0], "2": [0, 3], "3": [0]}
    assert data["steps"][-1]["ranks"][2]["holds"] == {str(c): [0, 1, 2, 3] for c in range(4)}


def test_many_ranks_are_summarised() -> None:
    code, out = run("ring", "--ranks", "16", "--bytes", "64K")
    assert code == 0, out
    assert "rank 15" in out and "rank 7" not in out and "all 16 ranks" in out
    assert "steps: 30" in out


def test_pictures(tmp_path: Path) -> None:
    pngs = {name: tmp_path / f"{name}.png" for name in ("double_tree", "ring", "1f1b")}
    assert run("double_tree", "--ranks", "8", "--png", str(pngs["double_tree"]))[0] == 0
    code, out = run(
        "ring", "--ranks", "4", "--png", str(pngs["ring"]), "--animate", str(tmp_path / "ring.gif")
    )
    assert code == 0, out
    assert run("1f1b", "--stages", "4", "--micro-batches", "8", "--png", str(pngs["1f1b"]))[0] == 0
    for path in pngs.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "ring.gif").read_bytes()[:6] == b"GIF89a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "1f1b.png",
        "double_tree.png",
        "ring.gif",
        "ring.png",
    ]


def test_trees_draw_for_many_ranks_but_holdings_pictures_are_refused_up_front(tmp_path: Path) -> None:
    code, out = run("double_tree", "--ranks", "16", "--png", str(tmp_path / "dt.png"))
    assert code == 0, out
    assert (tmp_path / "dt.png").exists()
    code, out = run("ring", "--ranks", "16", "--png", str(tmp_path / "ring.png"))
    assert code == 2
    assert "pictures of holdings need --ranks 8 or fewer" in out
    assert "steps:" not in out  # refused before any work
    assert not (tmp_path / "ring.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bogus"], "choose one of ring, halving_doubling, tree, double_tree"),
        (["tree", "--collective", "all_gather"], "choose one of ring, halving_doubling, bfb"),
        (["ring", "--ranks", "1"], "--ranks must be between 2 and 256"),
        (["ring", "--ranks", "6", "--nodes", "4"], "--nodes must divide --ranks"),
        (["gpipe", "--ranks", "4"], "--ranks does not apply to a pipeline"),
        (["ring", "--stages", "2"], "--stages does not apply to a collective"),
        (["ring", "--png", "x.jpg"], "name a .png file"),
        (["ring", "--link", "nope"], "unknown link 'nope'"),
        (["ring", "--root", "1"], "--root applies to broadcast and reduce"),
        (["1f1b", "--stages", "0"], "--stages must be 1..64"),
    ],
)
def test_bad_input_exits_2_with_one_sentence_and_writes_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "steps.json"
    code, text = run(*args, "--json", str(out))
    assert code == 2
    assert message in text
    assert "Traceback" not in text
    assert not out.exists()


def test_send_ops_carry_the_schedule_bytes() -> None:
    w = walk("all_reduce", "bfb", 4, N)
    total = sum(op.numel for rank in w.schedule.steps for st in rank for op in st if op.kind is OpKind.SEND)
    assert sum(w.bytes_sent(r) for r in range(4)) == total * 4


def test_a_png_over_nodes_has_a_legend_and_marks_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from ringtree import plots
    from ringtree.cli.app import app

    saved: list[Any] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, rect=None: saved.append(fig))
    png = tmp_path / "ring.png"
    result = CliRunner().invoke(app, ["show", "ring", "--nodes", "2", "--png", str(png)])
    assert result.exit_code == 0, result.output
    (fig,) = saved
    legend = " ".join(t.get_text() for t in fig.texts)
    assert "how many ranks' inputs the chunk holds" in legend and "red outline" in legend
    assert "between nodes" in legend
    first = fig.axes[0]
    assert [t.get_text() for t in first.get_yticklabels()] == ["0 (n0)", "1 (n0)", "2 (n1)", "3 (n1)"]
    assert len(first.get_lines()) == 1  # the dashed line between node 0's ranks and node 1's
