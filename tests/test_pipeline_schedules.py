"""Pipeline schedules as data, their replay, and partitioning: exact cases, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtree.parallel.pipeline.partition import balance, partition, split
from ringtree.schedules.pipeline import (
    Action,
    Kind,
    PipelineSchedule,
    build,
    gpipe,
    one_f_one_b,
    pipedream,
    theoretical_bubble_fraction,
)
from ringtree.schedules.pipeline_verify import (
    DeadlockError,
    dry_run,
    peak_in_flight,
    peak_versions,
    staleness,
)
from ringtree.sim.network.hardware import Link
from ringtree.sim.training.pipeline import StageCosts, replay_pipeline
from ringtree.sim.training.plan import predict_pipeline
from ringtree.train.models import ViT
from ringtree.train.stages import model_layers

NAMES = ("gpipe", "1f1b", "pipedream", "pipedream-vs")


def test_gpipe_is_fill_drain() -> None:
    s = gpipe(2, 3)
    assert [s.describe(j) for j in range(2)] == ["F0 F1 F2 B0 B1 B2 S"] * 2


def test_1f1b_warms_up_then_alternates_then_drains() -> None:
    s = one_f_one_b(3, 4)
    assert [s.describe(j) for j in range(3)] == [
        "F0 F1 F2 B0 F3 B1 B2 B3 S",
        "F0 F1 B0 F2 B1 F3 B2 B3 S",
        "F0 B0 F1 B1 F2 B2 F3 B3 S",
    ]


def test_pipedream_steps_after_every_backward_with_stashed_versions() -> None:
    s = pipedream(2, 3)
    assert s.describe(0) == "F0 F1 B0 S F2 B1 S B2 S"
    assert [a.version for a in s.actions[0] if a.kind is not Kind.STEP] == [0, 0, 0, 1, 0, 1]
    assert [a.version for a in s.actions[0] if a.kind is Kind.STEP] == [1, 2, 3]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (2, 5), (4, 3), (4, 16), (5, 8)])
def test_every_schedule_runs_without_deadlock(name: str, p: int, m: int) -> None:
    assert dry_run(build(name, p, m)) > 0


def test_dry_run_finds_a_deadlock_and_an_out_of_order_receive() -> None:
    backward_first = (Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 0))
    bad = PipelineSchedule("bad", 2, 1, ((Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0)), backward_first))
    with pytest.raises(ValueError, match="backward of micro-batch 0 comes before its forward"):
        dry_run(bad)
    wait = (
        Action(Kind.FORWARD, 0),
        Action(Kind.FORWARD, 1),
        Action(Kind.BACKWARD, 0),
        Action(Kind.BACKWARD, 1),
    )
    eager = (
        Action(Kind.FORWARD, 0),
        Action(Kind.BACKWARD, 0),
        Action(Kind.FORWARD, 1),
        Action(Kind.BACKWARD, 1),
    )
    with pytest.raises(DeadlockError, match="deadlocks; stages wait at"):
        dry_run(PipelineSchedule("stuck", 2, 2, (eager, wait)))  # 0 waits for B0, 1 for F1
    swapped = (
        Action(Kind.FORWARD, 1),
        Action(Kind.FORWARD, 0),
        Action(Kind.BACKWARD, 0),
        Action(Kind.BACKWARD, 1),
    )
    with pytest.raises(DeadlockError, match="micro-batch 0 was sent first"):
        dry_run(PipelineSchedule("swapped", 2, 2, (wait, swapped)))


def test_1f1b_keeps_at_most_p_minus_j_micro_batches_in_flight_gpipe_all_m() -> None:
    p, m = 4, 8
    assert [peak_in_flight(gpipe(p, m), j) for j in range(p)] == [8, 8, 8, 8]
    assert [peak_in_flight(one_f_one_b(p, m), j) for j in range(p)] == [4, 3, 2, 1]


def test_pipedream_versions_are_bounded_and_staleness_is_p_minus_1_minus_j() -> None:
    p, m = 4, 8
    s = pipedream(p, m)
    assert [peak_versions(s, j) for j in range(p)] == [4, 3, 2, 1]
    assert [staleness(s, j)[-3:] for j in range(p)] == [[3, 3, 3], [2, 2, 2], [1, 1, 1], [0, 0, 0]]
    vs = pipedream(p, m, vertical_sync=True)
    assert [staleness(vs, j)[-1] for j in range(p)] == [3, 3, 3, 3]  # every stage as stale as stage 0
    forwards = [[a.version for a in vs.actions[j] if a.kind is Kind.FORWARD] for j in range(p)]
    assert forwards == [[0, 0, 0, 0, 1, 2, 3, 4]] * p  # one version per micro-batch across stages
    assert [staleness(gpipe(p, m), j) for j in range(p)] == [[0] * m] * p


def test_bad_schedule_arguments_name_the_values() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'afab'; choose one of gpipe, 1f1b"):
        build("afab", 2, 2)
    with pytest.raises(ValueError, match="stages=0, micro_batches=4"):
        gpipe(0, 4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 8), (4, 1), (4, 4), (4, 16)])
def test_replay_of_equal_stages_has_the_gpipe_bubble(name: str, p: int, m: int) -> None:
    r = replay_pipeline(build(name, p, m), StageCosts.uniform(p, 1.0, 2.0))
    assert r.step_time_s == pytest.approx(3.0 * (m + p - 1))
    assert r.bubble_fraction == pytest.approx(theoretical_bubble_fraction(p, m))


def test_replay_adds_each_hop_on_the_critical_path() -> None:
    link = Link("test", 0.5, 1e6)  # 0.5 s latency + 1 s for 1 MB
    r = replay_pipeline(gpipe(2, 1), StageCosts.uniform(2, 1.0, 2.0, activation_bytes=10**6), link)
    assert r.step_time_s == pytest.approx(6.0 + 2 * 1.5)  # forward hop and gradient hop
    slow = StageCosts((1.0, 3.0), (2.0, 6.0))
    assert replay_pipeline(gpipe(2, 4), slow).step_time_s == pytest.approx(1 + 4 * 3 + 4 * 6 + 2)


def test_balance_minimises_the_largest_stage() -> None:
    assert balance([1, 1, 1, 1, 10], 2) == [4, 1]
    assert balance([4, 1, 1, 1, 1, 4], 3) == [1, 4, 1]
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages; use between 1 and 3"):
        balance([1, 1, 1], 4)


def test_partition_errors_name_the_sizes() -> None:
    layers = [nn.Linear(2, 2) for _ in range(5)]
    with pytest.raises(ValueError, match=r"stage sizes \[2, 2\] add up to 4 but the model has 5 layers"):
        split(layers, [2, 2])
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6 stages"):
        partition(nn.Sequential(*layers), 6)
    with pytest.raises(ValueError, match="unknown balance 'flops'"):
        partition(layers, 2, by="flops")


@pytest.mark.parametrize("by", ["params", "time"])
def test_vit_stages_compose_to_the_vit(by: str) -> None:
    torch.manual_seed(0)
    vit, x = ViT(depth=4), torch.rand(3, 64)
    stages = partition(model_layers(vit), 3, by=by, sample=x)
    assert len(stages) == 3 and sum(len(s) for s in stages) == 6
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, vit(x))
    if by == "params":
        assert [len(s) for s in stages] == [2, 2, 2]  # tokens+block, block+block, block+head


def test_plan_prediction_splits_compute_over_stages_and_micro_batches() -> None:
    out = predict_pipeline("gpipe", 2, 2, 1.2, Link("free", 0.0, 1e30))
    assert out["pipeline_step_time_s"] == pytest.approx(0.9)  # (m + p - 1) x 1.2 / (p m)
    assert out["bubble_fraction"] == pytest.approx(1 / 3)
