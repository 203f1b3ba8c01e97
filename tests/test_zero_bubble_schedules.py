"""The zero-bubble schedules as data: golden per-stage orders, torch's own orders, the checks as data
(F before B before W, counts, a dry run over the V's transfers, peak activations within the published
bounds), the bubble of the replay against the published formulas, and bad input. No processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.schedules.pipeline import (
    SCHEDULES,
    ZERO_BUBBLE,
    Action,
    Kind,
    PipelineSchedule,
    build,
    check_layers,
    check_pipeline,
)
from ringtree.schedules.pipeline_verify import (
    DeadlockError,
    check_actions,
    dry_run,
    peak_in_flight,
    published_peak,
    verify,
)
from ringtree.show.pipeline import timeline
from ringtree.sim.network.hardware import Link
from ringtree.sim.training.pipeline import StageCosts, replay_pipeline

GOLDEN = {  # p = 4, m = 8; ".1" marks chunk 1 (the V's way back: virtual stage 2p-1-j)
    "zb-h1": (
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7 S",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7 S",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7 S",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7 S",
    ),
    "zb-h2": (
        "F0 F1 F2 F3 F4 F5 F6 B0 W0 B1 F7 B2 W1 B3 W2 B4 W3 B5 W4 B6 W5 W6 B7 W7 S",
        "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 B3 F7 B4 W1 B5 W2 B6 W3 W4 B7 W5 W6 W7 S",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 B5 F7 B6 W1 W2 B7 W3 W4 W5 W6 W7 S",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7 S",
    ),
    "zb-v": (
        (
            "F0 F1 F2 F3 F4 F5 F6 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F2.1 B2.1 W2.1 F3.1 B3.1 W3.1 F7 B0 W0 "
            "F4.1 B4.1 W4.1 B1 W1 F5.1 B5.1 W5.1 B2 W2 F6.1 B6.1 W6.1 B3 W3 F7.1 B7.1 W7.1 B4 W4 B5 W5 "
            "B6 W6 B7 W7 S"
        ),
        (
            "F0 F1 F2 F3 F4 F0.1 F5 F1.1 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B2.1 W2.1 F6 B0 W0 F4.1 B3.1 "
            "W3.1 F7 B1 W1 F5.1 B4.1 W4.1 B2 W2 F6.1 B5.1 W5.1 B3 W3 F7.1 B6.1 W6.1 B4 B7.1 B5 W4 B6 W5 "
            "B7 W6 W7.1 W7 S"
        ),
        (
            "F0 F1 F2 F0.1 F3 F1.1 F4 F2.1 B0.1 W0.1 F3.1 B1.1 W1.1 F5 B0 W0 F4.1 B2.1 W2.1 F6 B1 W1 "
            "F5.1 B3.1 W3.1 F7 B2 W2 F6.1 B4.1 W4.1 B3 W3 F7.1 B5.1 W5.1 B4 B6.1 B5 B7.1 B6 W4 B7 W5 "
            "W6.1 W7.1 W6 W7 S"
        ),
        (
            "F0 F0.1 F1 F1.1 F2 F2.1 F3 F3.1 B0.1 W0.1 F4 B0 W0 F4.1 B1.1 W1.1 F5 B1 W1 F5.1 B2.1 W2.1 "
            "F6 B2 W2 F6.1 B3.1 W3.1 F7 B3 W3 F7.1 B4.1 W4.1 B4 B5.1 B5 B6.1 B6 B7.1 B7 W4 W5.1 W6.1 "
            "W7.1 W5 W6 W7 S"
        ),
    ),
    "dualpipev": (
        (
            "F0 F1 F2 F3 F4 F5 F6 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F2.1 B2.1 W2.1 F3.1 F7 B3.1 W3.1 F4.1 "
            "B0 W0 B4.1 W4.1 F5.1 B1 W1 B5.1 W5.1 F6.1 B2 W2 B6.1 W6.1 F7.1 B3 W3 B7.1 W7.1 B4 W4 B5 W5 "
            "B6 W6 B7 W7 S"
        ),
        (
            "F0 F1 F2 F3 F4 F0.1 F5 F1.1 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 F6 B2.1 W2.1 F4.1 B0 W0 F7 B3.1 "
            "W3.1 F5.1 B1 W1 B4.1 W4.1 F6.1 B2 W2 B5.1 W5.1 F7.1 B3 W3 B6.1 W6.1 B4 W4 B7.1 B5 W7.1 B6 "
            "W5 B7 W6 W7 S"
        ),
        (
            "F0 F1 F2 F0.1 F3 F1.1 F4 F2.1 B0.1 W0.1 F3.1 F5 B1.1 W1.1 F4.1 B0 W0 F6 B2.1 W2.1 F5.1 B1 "
            "W1 F7 B3.1 W3.1 F6.1 B2 W2 B4.1 W4.1 F7.1 B3 W3 B5.1 W5.1 B4 W4 B6.1 W6.1 B5 B7.1 B6 W5 B7 "
            "W7.1 W6 W7 S"
        ),
        (
            "F0 F0.1 F1 F1.1 F2 F2.1 F3 F3.1 F4 B0.1 W0.1 F4.1 B0 W0 F5 B1.1 W1.1 F5.1 B1 W1 F6 B2.1 "
            "W2.1 F6.1 B2 W2 F7 B3.1 W3.1 F7.1 B3 W3 B4.1 W4.1 B4 W4 B5.1 W5.1 B5 W5 B6.1 B6 B7.1 B7 "
            "W6.1 W6 W7.1 W7 S"
        ),
    ),
}
GRID = [(2, 4), (3, 6), (4, 8), (4, 10), (5, 12), (8, 16)]  # m >= 2p: every schedule runs


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_golden_per_stage_orders_at_p4_m8(name: str) -> None:
    s = build(name, 4, 8)
    assert tuple(s.describe(j) for j in range(4)) == GOLDEN[name]
    assert s.splits_backward and name in SCHEDULES
    assert (s.virtual_stages, s.placement) == ((2, "v") if name in ("zb-v", "dualpipev") else (1, "loop"))


def _torch_order(name: str, p: int, m: int) -> list[str]:
    """torch.distributed.pipelining's per-rank order in our notation: I is our B, W our W, a whole
    backward B then W, an OVERLAP_F_B its F then its backward; idle slots dropped."""
    cls = {
        "zb-h1": torch_schedules.ScheduleInterleavedZeroBubble,
        "zb-v": torch_schedules.ScheduleZBVZeroBubble,
        "dualpipev": torch_schedules.ScheduleDualPipeV,
    }[name]
    o = object.__new__(cls)  # only the order generator: no process group, no stages
    chunks = 1 if name == "zb-h1" else 2
    o.pp_group_size, o._n_microbatches, o.num_stages, o.n_local_stages = p, m, chunks * p, chunks
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    out = []
    for r in range(p):
        words = []
        for a in o._calculate_single_rank_operations(r):
            for x in () if a is None else a.sub_actions or (a,):
                c = ".1" if chunks == 2 and x.stage_index >= p else ""
                kind = {torch_schedules.F: "F", torch_schedules.I: "B", torch_schedules.W: "W"}
                words += (
                    [f"B{x.microbatch_index}{c}", f"W{x.microbatch_index}{c}"]
                    if x.computation_type == torch_schedules.B
                    else [f"{kind[x.computation_type]}{x.microbatch_index}{c}"]
                )
        out.append(" ".join([*words, "S"]))
    return out


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipev"])
@pytest.mark.parametrize(("p", "m"), GRID)
def test_the_order_is_torchs(name: str, p: int, m: int) -> None:
    assert [build(name, p, m).describe(j) for j in range(p)] == _torch_order(name, p, m)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
@pytest.mark.parametrize(("p", "m"), [*GRID, (1, 2), (2, 2 * 2 * 3), (6, 36)])
def test_every_schedule_passes_the_checks_as_data(name: str, p: int, m: int) -> None:
    s = build(name, p, m)
    assert verify(s) > 0
    peaks = [peak_in_flight(s, j) for j in range(p)]
    assert max(peaks) <= published_peak(s)  # type: ignore[operator]
    if name in ("zb-h1", "zb-h2"):  # W holds the rest: the same count on every stage (Qi et al.)
        assert peaks == [min(m, p if name == "zb-h1" else 2 * p - 1)] * p
    if name == "zb-h1":  # stage j's first W waits j steady rounds: it follows B j
        for j in range(p):
            words = s.describe(j).split()
            assert words[words.index("W0") - 1] == f"B{min(j, m - 1)}"


def test_the_bounds_are_the_published_ones() -> None:
    p, m = 4, 8
    assert {n: published_peak(build(n, p, m)) for n in ZERO_BUBBLE} == {
        "zb-h1": 4, "zb-h2": 7, "zb-v": 8, "dualpipev": 9,
    }  # fmt: skip
    assert [max(peak_in_flight(build(n, p, m), j) for j in range(p)) for n in ZERO_BUBBLE] == [4, 7, 8, 9]


def test_the_checks_catch_a_w_before_its_b_a_missing_w_and_a_v_that_deadlocks() -> None:
    good = build("zb-h1", 1, 2).actions[0]
    early = (Action(Kind.FORWARD, 0), Action(Kind.WEIGHT, 0), Action(Kind.BACKWARD, 0), *good[3:])
    with pytest.raises(ValueError, match="the W of micro-batch 0 comes before its B"):
        check_actions(PipelineSchedule("bad", 1, 2, (early,)))
    missing = tuple(a for a in good if not (a.kind is Kind.WEIGHT and a.micro_batch == 1))
    with pytest.raises(ValueError, match=r"weight gradients .* one for every B"):
        check_actions(PipelineSchedule("bad", 1, 2, (missing,)))
    v = build("zb-v", 2, 4)
    last = v.actions[1]  # the last stage's chunk 1 needs its own chunk 0's output first: swap them
    swapped = (Action(Kind.FORWARD, 0, chunk=1), *(a for a in last if a != Action(Kind.FORWARD, 0, chunk=1)))
    with pytest.raises(DeadlockError):
        dry_run(PipelineSchedule("v", 2, 4, (v.actions[0], swapped), 2, "v"))


def test_the_v_placement_maps_chunks_to_virtual_stages_and_back() -> None:
    s = build("zb-v", 4, 8)
    assert [s.virtual_of(j, c) for c in (0, 1) for j in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(s.stage_of(s.virtual_of(j, c)) == (j, c) for j in range(4) for c in (0, 1))
    t = s.send_of(3, Action(Kind.FORWARD, 0, chunk=0))
    assert t is not None and (t.src, t.dst) == (3, 4) and s.stage_of(t.dst) == (3, 1)  # the turn
    assert s.recv_of(0, Action(Kind.BACKWARD, 0, chunk=1)) is None  # the loss is on stage 0's chunk 1
    with pytest.raises(ValueError, match="unknown placement 'w'"):
        PipelineSchedule("x", 1, 1, ((),), placement="w")


def _bubble(name: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """Idle seconds per stage in the replayed step with forward f, B b and W w a stage."""
    costs = StageCosts((f,) * p, (b + w,) * p, weight_s=(w,) * p)
    return replay_pipeline(build(name, p, m), costs).step_time_s - m * (f + b + w)


@pytest.mark.parametrize(
    ("f", "b", "w"), [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5), (1.5, 1.0, 1.0)]
)
@pytest.mark.parametrize(("p", "m"), [(4, 8), (6, 24)])
def test_the_replayed_bubble_is_the_published_formula(p: int, m: int, f: float, b: float, w: float) -> None:
    assert _bubble("1f1b", p, m, f, b, w) == pytest.approx((p - 1) * (f + b + w))
    assert _bubble("zb-h1", p, m, f, b, w) == pytest.approx((p - 1) * (f + b - w))  # Qi et al., Table 2
    # their (p-1)(F+B-2W) without the optimizer's synchronization; one synchronous step adds the wait
    # of the last stage for its first forward, (p-1) F, as a floor
    assert _bubble("zb-h2", p, m, f, b, w) == pytest.approx(max((p - 1) * (f + b - 2 * w), (p - 1) * f))
    if f == b == w:  # zero bubble but for the same fill, of chunk forwards (half a stage's)
        assert _bubble("zb-v", p, m, f, b, w) == pytest.approx((p - 1) * f / 2)


def test_bad_input_names_the_flag_and_the_smallest_value_that_works() -> None:
    for name, least in (("zb-v", 8), ("dualpipev", 8), ("zb-h1", 4), ("zb-h2", 4)):
        with pytest.raises(
            ValueError, match=f"--schedule {name} on 4 stages needs at least {least} micro-batches"
        ):
            build(name, 4, least - 1)
        with pytest.raises(ValueError, match=f"use --micro-batches {least}$"):
            check_pipeline(4, least - 1, name, "params")
        build(name, 4, least)
    with pytest.raises(ValueError, match=r"into 8 chunks, but it has 6 layers; .* --pp 3"):
        check_layers("zb-v", 4, 6)
    check_layers("zb-v", 4, 8)
    check_layers("zb-h1", 4, 4)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_the_timeline_has_f_b_and_w_one_slot_each(name: str) -> None:
    p, m = 4, 8
    t = timeline(name, p, m)
    v = t.schedule.virtual_stages
    for row in t.slots:
        ops = [slot.op for slot in row]
        assert [ops.count(op) for op in ("forward", "backward", "weight")] == [v * m] * 3
    assert t.bubble_fraction == pytest.approx(1 - 3 * v * m / len(t.slots[0]))
    if name in ("zb-h1", "zb-h2"):  # the formula at F = B = W = one slot: (p-1)/(3m+p-1), a third of 1F1B's
        assert t.bubble_fraction == pytest.approx(t.theoretical_bubble_fraction) == 3 / 27
        assert t.bubble_fraction < timeline("1f1b", p, m).bubble_fraction / 2


def test_show_zb_v_prints_the_v_and_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "zbv.json", tmp_path / "zbv.png"
    args = ["show", "zb-v", "--stages", "4", "--micro-batches", "8", "--json", str(out), "--png", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "stage j holds chunks j and 2p-1-j" in text and "W0.1" in text and "B input gradient" in text
    data = json.loads(out.read_text())
    assert (data["placement"], data["splits_backward"], data["virtual_stages"]) == ("v", True, 2)
    assert data["activations_in_flight"] == [8, 8, 8, 8]
    ops = {e["op"] for step in data["steps"] for e in step["stages"]}
    assert ops == {"forward", "backward", "weight", "idle"}
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(("name", "least"), [("zb-v", 8), ("dualpipev", 8), ("zb-h1", 4), ("zb-h2", 4)])
def test_show_refuses_too_few_micro_batches_with_exit_2(name: str, least: int) -> None:
    result = CliRunner().invoke(app, ["show", name, "--stages", "4", "--micro-batches", str(least - 1)])
    assert result.exit_code == 2
    assert f"use --micro-batches {least}" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_the_vs_turn_on_one_stage_pays_no_link() -> None:
    """One stage holding both chunks: every transfer is the V's turn on that stage, so a link that
    costs a second a message adds nothing; two stages pay it on the messages between them."""
    slow = Link("slow", 1.0, 1e30)
    costs = StageCosts.uniform(1, 1.0, 2.0)
    s = build("zb-v", 1, 2)
    assert replay_pipeline(s, costs, slow).step_time_s == replay_pipeline(s, costs).step_time_s == 6.0
    two = build("zb-v", 2, 4)
    assert replay_pipeline(two, StageCosts.uniform(2, 1.0, 2.0), slow).step_time_s > 12.0 + 2.0
