"""The simulator's hardware model, closed forms (exact on small cases) and their agreement with replay."""

from __future__ import annotations

import math
import time

import pytest

from ringtree.schedules import Request, build
from ringtree.sim import INTER, INTRA, Cluster, Link, estimate, make_cluster, replay_all_reduce
from ringtree.sim.network.closed_form import ALGORITHMS
from ringtree.sim.network.hardware import parse_link
from ringtree.topology import Topology

A, BW, G = 5e-6, 1e9, 1e-10  # alpha, bandwidth, gamma of the exact-formula cases
LINK = Link("test", A, BW)


def one_level(p: int, gamma: float = G) -> Cluster:
    return Cluster(1, p, LINK, LINK, gamma)


def test_presets_cover_the_issue_and_match_their_sources() -> None:
    assert set(INTRA) == {"pcie-gen3", "pcie-gen4", "pcie-gen5", "nvlink-v100", "nvlink-a100", "nvlink-h100"}
    assert set(INTER) == {"eth-1g", "eth-10g", "eth-25g", "eth-100g", "ib-hdr", "ib-ndr", "efa-400g"}
    assert INTRA["pcie-gen3"].bandwidth_Bps == pytest.approx(15.75e9)
    assert INTRA["nvlink-h100"].bandwidth_Bps == pytest.approx(450e9)
    assert INTER["eth-10g"].bandwidth_Bps == pytest.approx(1.25e9)
    assert INTER["ib-hdr"].bandwidth_Bps == pytest.approx(25e9)
    assert INTER["ib-ndr"].bandwidth_Bps == pytest.approx(50e9)


def test_custom_links_parse_units_and_reject_nonsense() -> None:
    link = parse_link("bw=100Gbit/s,lat=3us", INTER)
    assert link.bandwidth_Bps == pytest.approx(12.5e9) and link.alpha_s == pytest.approx(3e-6)
    assert parse_link("bw=2GB/s,lat=1ms", INTER).beta == pytest.approx(0.5e-9)
    with pytest.raises(ValueError, match="eth-10g"):
        parse_link("eth-9g", INTER)
    with pytest.raises(ValueError, match="units"):
        parse_link("bw=3furlongs,lat=1us", INTER)
    with pytest.raises(ValueError, match="calibration"):
        make_cluster(2, 8, "pcie-gen3", None)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_textbook_formulas_on_one_level(p: int) -> None:
    n = 4 * 1024 * p  # bytes, a multiple of p elements
    lg = int(math.log2(p))
    c = one_level(p)
    ring = 2 * (p - 1) * A + 2 * (p - 1) / p * n / BW + (p - 1) / p * n * G
    assert estimate("ring", c, n) == pytest.approx(ring, rel=1e-12)
    rabenseifner = 2 * lg * A + 2 * (p - 1) / p * n / BW + (p - 1) / p * n * G
    assert estimate("halving_doubling", c, n) == pytest.approx(rabenseifner, rel=1e-12)
    assert estimate("ps", c, n) == pytest.approx(2 * A + 2 * (p - 1) * n / BW + (p - 1) * n * G, rel=1e-12)
    assert estimate("bfb", c, n) == pytest.approx(2 * A + 2 * (p - 1) / p * n / BW + (p - 1) / p * n * G)
    assert estimate("native", c, n) == estimate("ring", c, n)


@pytest.mark.parametrize("algorithm", ["tree", "double_tree"])
@pytest.mark.parametrize("p", [2, 5, 8, 16])
def test_tree_latency_is_the_schedules_step_count(algorithm: str, p: int) -> None:
    fast = Cluster(1, p, Link("latency only", A, 1e30), Link("latency only", A, 1e30), 0.0)
    steps = build(Request("all_reduce", algorithm, Topology(p, p), 4 << 20)).num_steps
    assert estimate(algorithm, fast, 16 << 20) == pytest.approx(steps * A)


def test_two_level_ring_and_hierarchical_exactly() -> None:
    intra, inter = INTRA["pcie-gen3"], INTER["eth-10g"]
    c = Cluster(3, 8, intra, inter, 0.0)
    n = 24 * 4096 * 4
    # The ring crosses each NIC once per step: the slow inter-node hop paces all 2(p-1) steps.
    assert estimate("ring", c, n) == pytest.approx(46 * (inter.alpha_s + n / 24 * inter.beta))
    # Hierarchical: 7 intra steps of n/8, then 8 rails share each NIC for 4 steps of n/24, 7 intra.
    intra_step = intra.alpha_s + n / 8 * intra.beta
    inter_step = inter.alpha_s + n / 24 * inter.beta * 8
    assert estimate("hierarchical", c, n) == pytest.approx(14 * intra_step + 4 * inter_step)


SHAPES = [(1, p) for p in (2, 3, 5, 6, 8, 12, 16, 64)] + [
    (2, 1), (2, 4), (2, 8), (4, 2), (4, 8), (8, 8), (2, 3), (3, 4), (3, 8), (6, 2), (64, 1),
]  # fmt: skip


# Where the closed form still misses by more than 2% (docs/simulator.md): the folded
# halving-doubling across nodes, whose fold and first exchange share a NIC at different steps
# (the closed form slows the later flow but not the earlier one), and one double tree shape.
KNOWN_MISSES = {(2, 3, "halving_doubling"): 0.14, (6, 2, "double_tree"): 0.05}


@pytest.mark.parametrize(("nodes", "local"), SHAPES)
def test_closed_form_agrees_with_replay(nodes: int, local: int) -> None:
    """Within 2% for every algorithm, size and shape but the known misses above.

    Steps are costed along each rank's dependency path, and flows share a port or NIC only while
    they overlap in time, as in the replay.
    """
    c = Cluster(nodes, local, INTRA["pcie-gen4"], INTER["eth-25g"])
    for algorithm in ALGORITHMS:
        tolerance = KNOWN_MISSES.get((nodes, local, algorithm), 0.02)
        for nbytes in (4096, 1 << 20, 16 << 20):
            closed, replay = estimate(algorithm, c, nbytes), replay_all_reduce(algorithm, c, nbytes)
            assert closed == pytest.approx(replay, rel=tolerance), (algorithm, nbytes)


def test_replay_sees_nic_sharing() -> None:
    """Eight rails through one NIC: the replay's inter phase takes eight times one flow's time."""
    inter = Link("slow", 0.0, 1e9)
    fast = Link("fast", 0.0, 1e15)
    c = Cluster(2, 8, fast, inter, 0.0)
    n = 16 * 1024 * 4
    assert replay_all_reduce("hierarchical", c, n) == pytest.approx(2 * (n / 16) * 8 / 1e9, rel=1e-3)


def test_closed_form_scales_to_24576_ranks() -> None:
    c = Cluster(3072, 8, INTRA["nvlink-a100"], INTER["ib-hdr"])
    for algorithm in ALGORITHMS:
        start = time.perf_counter()
        assert estimate(algorithm, c, 64 << 20) > 0
        assert time.perf_counter() - start < 5.0, algorithm  # about 0.3 s at most on an idle core
    ring, tree = estimate("ring", c, 8), estimate("double_tree", c, 8)
    assert ring > 100 * tree  # O(p) against O(log p) latency


@pytest.mark.parametrize(("nodes", "local"), [(8, 8), (2, 3), (16, 1), (4, 16)])
def test_ring_with_fewer_elements_than_ranks(nodes: int, local: int) -> None:
    """Empty blocks are skipped, so tiny messages travel chains; the blend stays within 7%."""
    c = Cluster(nodes, local, INTRA["nvlink-a100"], INTER["ib-hdr"])
    for count in (1, 2, nodes, c.ranks // 2, c.ranks - 1):
        closed, replay = estimate("ring", c, 4 * count), replay_all_reduce("ring", c, 4 * count)
        assert closed == pytest.approx(replay, rel=0.07), count
