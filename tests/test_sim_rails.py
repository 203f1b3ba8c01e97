"""Groups that span nodes use every NIC of a node: NCCL runs one ring (channel) per rail."""

from __future__ import annotations

import dataclasses

import pytest

from ringtree.sim.network.closed_form import estimate, rails
from ringtree.sim.network.clusters import get
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.plan import tp_group

NVLINK = Link("nvlink", 0.0, 450e9)
NIC = Link("nic", 0.0, 50e9)
GIB = 1 << 30


def ring_theory(p: int, nbytes: int, bandwidth: float) -> float:
    """Bandwidth term of a ring all-reduce: 2 (p-1)/p n / B."""
    return 2 * (p - 1) / p * nbytes / bandwidth


@pytest.mark.parametrize("nodes, per_node, nics", [(1, 8, 8), (2, 8, 1), (4, 4, 1), (3, 8, 1)])
def test_native_is_the_ring_with_one_nic_or_one_node(nodes: int, per_node: int, nics: int) -> None:
    cluster = Cluster(nodes, per_node, NVLINK, NIC, nics_per_node=nics)
    for nbytes in (8, 4096, 1 << 20, 3 * 10**7 + 4):
        assert estimate("native", cluster, nbytes) == estimate("ring", cluster, nbytes)


@pytest.mark.parametrize("nodes, nics", [(2, 8), (4, 8), (2, 4), (3, 2)])
def test_native_uses_every_nic(nodes: int, nics: int) -> None:
    """Large buffers: the network carries the ring's bytes over all of a node's NICs together."""
    cluster = Cluster(nodes, 8, NVLINK, NIC, gamma=0.0, nics_per_node=nics)
    assert rails(cluster) == nics
    p = cluster.ranks
    expected = ring_theory(p, GIB, nics * NIC.bandwidth_Bps)
    assert estimate("native", cluster, GIB) == pytest.approx(expected, rel=0.01)
    one_nic = ring_theory(p, GIB, NIC.bandwidth_Bps)  # ringtree's single ring crosses on one NIC
    assert estimate("ring", cluster, GIB) == pytest.approx(one_nic, rel=0.01)


def test_a_tp_group_larger_than_a_node_keeps_the_nics() -> None:
    cluster = get("dgx-h100").cluster(8)
    group = tp_group(cluster, 16)
    assert (group.nodes, group.gpus_per_node, group.nics_per_node) == (2, 8, 8)


def test_tp16_all_reduce_costs_a_small_multiple_of_tp8() -> None:
    """One TP all-reduce of a GPT-3 175B activation (2048 tokens x 12288 x bf16): over 2 DGX H100
    nodes with their 8 NICs it stays within twice the one-node cost (the single ring: 5x and more)."""
    cluster = get("dgx-h100").cluster(8)
    nbytes = 2048 * 12288 * 2
    tp8 = estimate("native", tp_group(cluster, 8), nbytes, 2)
    tp16 = estimate("native", tp_group(cluster, 16), nbytes, 2)
    assert 1.0 < tp16 / tp8 < 2.0
    assert estimate("ring", tp_group(cluster, 16), nbytes, 2) / tp8 > 5.0
    one_nic = dataclasses.replace(tp_group(cluster, 16), nics_per_node=1)
    assert estimate("native", one_nic, nbytes, 2) / tp8 > 5.0
