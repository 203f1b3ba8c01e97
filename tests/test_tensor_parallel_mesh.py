"""The process mesh: rank layout as data and topology rules (real groups: test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from ringtree.parallel import MeshShape
from ringtree.topology import Topology


def test_layout_tp_innermost_then_dp_then_pp_outermost() -> None:
    shape = MeshShape(dp=2, tp=2, pp=2)  # Megatron-LM's order: rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    assert sorted(shape.tp_groups()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(shape.dp_groups()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(shape.pp_groups()) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [shape.coordinates(r) for r in (0, 3, 5)] == [(0, 0, 0), (1, 1, 0), (0, 1, 1)]
    assert all(shape.rank_of(*shape.coordinates(r)) == r for r in range(8))


def test_every_rank_in_exactly_one_group_of_each_kind() -> None:
    shape = MeshShape(dp=3, tp=2, pp=2)
    for groups in (shape.tp_groups(), shape.dp_groups(), shape.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(12))


def test_tp_group_must_fit_in_a_node() -> None:
    MeshShape(dp=4, tp=2).check_topology(Topology(8, 4))  # 2 divides 4 ranks per node
    with pytest.raises(ValueError, match=r"tp=8 does not divide the 4 ranks per node"):
        MeshShape(dp=1, tp=8).check_topology(Topology(8, 4))
    MeshShape(dp=1, tp=8).check_topology(Topology(8, 4), allow_cross_node_tp=True)


def test_mesh_must_fill_the_world() -> None:
    with pytest.raises(ValueError, match=r"dp=2 x tp=4 x pp=1 = 8 ranks but the world has 4"):
        MeshShape(dp=2, tp=4).check_topology(Topology(4, 4))
    with pytest.raises(ValueError, match=r"tp must be at least 1, got tp=0"):
        MeshShape(dp=1, tp=0)
