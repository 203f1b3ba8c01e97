"""One placement of ranks (ringtree.ranks): Megatron-LM's order, the same groups as the trainer's mesh."""

from __future__ import annotations

import itertools

import pytest

from ringtree.parallel import MeshShape
from ringtree.parallel.expert import fold
from ringtree.ranks import Placement, Span


def test_rank_is_megatron_order_tp_cp_dp_pp_innermost_first() -> None:
    p = Placement(tp=2, cp=3, dp=2, pp=2)
    for tp, cp, dp, pp in itertools.product(range(2), range(3), range(2), range(2)):
        rank = ((pp * 2 + dp) * 3 + cp) * 2 + tp  # Megatron's RankGenerator order "tp-cp-ep-dp-pp"
        assert p.rank(tp=tp, cp=cp, dp=dp, pp=pp) == rank
        assert p.coordinates(rank) == (tp, cp, dp, pp)
    with pytest.raises(ValueError, match="rank 24 is outside the 24 ranks"):
        p.coordinates(24)


def test_three_nodes_of_eight_pp4_dp6_stage_one_spans_two_nodes() -> None:
    p = Placement(dp=6, pp=4, gpus_per_node=8)
    assert p.pp_groups()[0] == [0, 6, 12, 18]
    assert p.dp_groups()[1] == [6, 7, 8, 9, 10, 11]
    assert p.nodes_of(p.dp_groups()[1]) == {0: 2, 1: 4}
    crossing = [(a, b) for a, b in p.stage_boundaries()[0] if p.node_of(a) != p.node_of(b)]
    assert crossing == [(2, 8), (3, 9), (4, 10), (5, 11)]  # stage 0 -> 1: ranks 2-5 send to node 1


def test_stage_boundaries_wrap_with_virtual_stages() -> None:
    assert len(Placement(dp=2, pp=3).stage_boundaries()) == 2
    wrapped = Placement(dp=2, pp=3, virtual_stages=2).stage_boundaries()
    assert wrapped[-1] == [(4, 0), (5, 1)]  # the last stage's chunk c feeds the first's chunk c + 1
    assert Placement(dp=4).stage_boundaries() == []


LAYOUTS = [(1, 1, 8, 1), (2, 1, 2, 2), (2, 2, 2, 1), (4, 1, 3, 2), (2, 2, 2, 3), (1, 2, 3, 4)]


@pytest.mark.parametrize(("tp", "cp", "dp", "pp"), LAYOUTS)
def test_groups_equal_the_trainer_mesh(tp: int, cp: int, dp: int, pp: int) -> None:
    p, mesh = Placement(tp=tp, cp=cp, dp=dp, pp=pp), MeshShape(dp=dp, tp=tp, pp=pp, cp=cp)
    assert p.tp_groups() == mesh.tp_groups()
    assert p.cp_groups() == mesh.cp_groups()
    assert p.dp_groups() == mesh.dp_groups()
    assert p.pp_groups() == mesh.pp_groups()
    assert p.dp_cp_groups() == mesh.dp_cp_groups()
    for rank in range(p.world_size):
        c = p.coordinates(rank)
        assert mesh.coordinates(rank) == (c.dp, c.tp, c.pp) and mesh.cp_rank(rank) == c.cp
    for groups in (p.tp_groups(), p.cp_groups(), p.dp_groups(), p.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(p.world_size))


@pytest.mark.parametrize(("tp", "cp", "dp", "ep"), [(1, 1, 8, 4), (2, 1, 4, 2), (2, 2, 2, 4), (1, 2, 2, 2)])
def test_expert_groups_equal_the_trainers_fold(tp: int, cp: int, dp: int, ep: int) -> None:
    """The trainer folds EP inside each DP x CP group: the expert mesh with etp = tp."""
    p = Placement(tp=tp, cp=cp, dp=dp, pp=2, ep=ep, etp=tp)
    ep_groups, edp_groups = fold(p.dp_cp_groups(), ep)
    assert sorted(p.ep_groups()) == sorted(ep_groups)
    assert sorted(p.edp_groups()) == sorted(edp_groups)


def test_expert_mesh_etp_innermost_then_ep() -> None:
    p = Placement(tp=2, dp=4, ep=2, etp=2)
    assert p.etp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert p.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"ep=4 x etp=4 must divide the 8 ranks of a pipeline stage"):
        Placement(tp=2, dp=4, ep=4, etp=4)


def test_span_counts_the_nodes_and_the_groups_sharing_them() -> None:
    p = Placement(dp=6, pp=4, gpus_per_node=8)
    dp = p.span(*p.progression("dp"))
    assert (dp.size, dp.nodes, dp.sharing) == (6, 2, 2)  # node 1 holds part of stage 1's and stage 2's
    assert p.boundary_span().sharing == 4  # ranks 2-5 of node 0 send to node 1
    one = Placement(tp=8, pp=3, gpus_per_node=8)
    assert one.span(*one.progression("tp")).nodes == 1 and one.boundary_span().sharing == 8
    inside = Placement(tp=2, dp=4, pp=1, gpus_per_node=8)
    assert inside.span(*inside.progression("dp")) == inside.span(2, 4)
    assert (inside.span(2, 4).nodes, inside.span(2, 4).sharing) == (1, 0)
    assert inside.boundary_span().nodes == 1


@pytest.mark.parametrize(("tp", "cp", "dp", "pp"), [(1, 1, 6, 4), (2, 2, 3, 2), (4, 1, 2, 3), (1, 2, 12, 1)])
def test_span_agrees_with_the_groups_themselves(tp: int, cp: int, dp: int, pp: int) -> None:
    p = Placement(tp=tp, cp=cp, dp=dp, pp=pp, gpus_per_node=8)
    for kind, groups in (("tp", p.tp_groups()), ("dp_cp", p.dp_cp_groups()), ("cp", p.cp_groups())):
        spans = [len(p.nodes_of(g)) for g in groups]
        crossing = [n for g, s in zip(groups, spans, strict=True) if s > 1 for n in p.nodes_of(g)]
        sharing = max((crossing.count(n) for n in set(crossing)), default=0)
        assert p.span(*p.progression(kind)) == Span(len(groups[0]), max(spans), sharing), kind


def test_replicas_are_contiguous_blocks_of_whole_pipelines() -> None:
    p = Placement(tp=2, dp=4, pp=2, replicas=2, gpus_per_node=8)  # 16 ranks, a replica per node
    assert p.replica_groups() == [list(range(8)), list(range(8, 16))]
    assert p.replica_dp_groups()[:2] == [[0, 2], [1, 3]]  # DDP inside replica 0, stage 0
    assert p.across_replicas_groups()[0] == [0, 8]  # the outer all-reduce: one rank per replica
    assert all(len({p.replica_of(r) for r in g}) == 1 for g in p.pp_groups())  # a pipeline in one replica
    assert all(p.nodes_of(g) == {p.node_of(g[0]): len(g)} for g in p.replica_groups())
    for rank in range(16):
        assert p.rank(*p.coordinates(rank)) == rank
    with pytest.raises(ValueError, match="replicas=3 must divide dp=4"):
        Placement(dp=4, replicas=3)
