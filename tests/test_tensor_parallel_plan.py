"""The planner's tensor-parallel cost: four activation all-reduces per block, on the TP group's link."""

from __future__ import annotations

import pytest

from ringtree.sim.network.closed_form import estimate
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.network.presets import LINKS
from ringtree.sim.training.tensor_parallel import TPShape, spread_cluster, tp_cluster, tp_comm_time

SHAPE = TPShape(layers=96, hidden=12288, seq=2048, batch_size=1, dtype_bytes=2)
CLUSTER = Cluster(8, 8, LINKS["nvlink-h100"], LINKS["eth-100g"])


def test_four_all_reduces_of_the_activation_per_block() -> None:
    assert SHAPE.activation_bytes == 2048 * 12288 * 2
    group = tp_cluster(CLUSTER, 8)
    assert (group.nodes, group.gpus_per_node) == (1, 8)
    assert tp_comm_time(SHAPE, group) == pytest.approx(
        4 * 96 * estimate("ring", group, SHAPE.activation_bytes, 2)
    )


def test_tp_across_slow_nodes_costs_far_more_than_inside_a_node() -> None:
    inside = tp_comm_time(SHAPE, tp_cluster(CLUSTER, 8))
    across = tp_comm_time(SHAPE, spread_cluster(CLUSTER, 8))
    assert across > 10 * inside


def test_tp_that_fits_no_node_layout_names_the_numbers() -> None:
    with pytest.raises(ValueError, match="tp=3 must divide the 64 ranks"):
        tp_cluster(CLUSTER, 3)
    assert tp_cluster(CLUSTER, 16).nodes == 2
