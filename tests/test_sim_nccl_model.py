"""NCCL's cost model: its algorithm and protocol choice at crossovers worked out by hand from tuning.cc."""

from __future__ import annotations

import pytest

from ringtree.sim import allreduce_time, make_cluster
from ringtree.sim.network import nccl_model as m
from ringtree.sim.network.nccl_system import Corrections, NcclTuning

DGX_A100 = m.system_from_links("ampere", "nvlink", 300e9, 8 * 25e9)  # nvlink-a100, 8 x ib-hdr


def ring_crossover(lat_a: float, bw_a: float, lat_b: float, bw_b: float) -> float:
    """Bytes where lat_a + n / (1000 bw_a) == lat_b + n / (1000 bw_b) (us, GB/s)."""
    return (lat_b - lat_a) / (1 / (1000 * bw_a) - 1 / (1000 * bw_b))


def test_dgx_a100_as_nccls_topology_search_sees_it() -> None:
    # 12 NVLinks x 20 GB/s (topo.h SM80_NVLINK_BW), two channels per link
    assert (DGX_A100.intra_bus_GBps, DGX_A100.channels, DGX_A100.nvls) == (240.0, 24, False)


def test_one_node_a100_crossovers_match_the_hand_computation() -> None:
    p, ratio = 8, 8 / 14  # ring algbw = busbw x nRanks / (2 (nRanks - 1))
    # LL: base 6.6 + 14 steps x 0.6 us; busBw min(llMaxBw 87.7, 240 x 0.5)
    ll = (6.6 + 14 * 0.6, 87.7 * ratio)
    # LL128: base 14 + 14 x 1.9; busBw min(240 x 0.92, 24 channels x 20)
    ll128 = (14.0 + 14 * 1.9, 240 * 0.92 * ratio)
    # Simple: base 8.4 + 14 x 3.4; busBw 240
    simple = (8.4 + 14 * 3.4, 240 * ratio)
    expected = [ring_crossover(*ll, *ll128), ring_crossover(*ll128, *simple)]
    found = m.crossovers(DGX_A100, p, 1)
    assert [(old, new) for _, old, new in found] == [("ring/LL", "ring/LL128"), ("ring/LL128", "ring/Simple")]
    for (size, _, _), want in zip(found, expected, strict=True):
        assert size == pytest.approx(want, rel=0.002)
    assert m.choose(DGX_A100, p, 1, 1 << 30).model_us == pytest.approx(
        simple[0] + (1 << 30) / (1000 * simple[1])
    )


def test_multi_node_starts_on_the_tree_and_ends_on_the_ring() -> None:
    picks = [m.choose(DGX_A100, 32, 4, n).label for n in (8, 1 << 20, 1 << 30)]
    assert picks == ["tree/LL", "tree/LL128", "ring/Simple"]
    tree_ll = m.choose(DGX_A100, 32, 4, 8)
    # base 6.8 + 2 x ((8 - 1) x 0.6 intra + log2(4) x 5.0 net)
    assert tree_ll.latency_intra_us + tree_ll.latency_inter_us == pytest.approx(6.8 + 2 * (7 * 0.6 + 2 * 5.0))


def test_nvls_only_on_hopper_nvswitch_and_ll128_only_on_nvlink() -> None:
    h100 = m.system_from_links("hopper", "nvlink", 450e9, 8 * 50e9)
    big = m.choose(h100, 8, 1, 1 << 30)
    assert h100.nvls and big.label == "nvls/Simple"
    # search.cc: 8 channels (one per GPU) at 50 GB/s (60 x 8 > 370.8 x 8/7), bwInter raised to 60;
    # tuning.cc: busBw = 8 x min(50 x 0.85 x 7/8 x 2, 60) = 480; latency: NVLink NVLS 25 us
    assert big.model_us == pytest.approx(25 + (1 << 30) / (1000 * 480 * 8 / 14))
    assert m.choose(h100, 16, 2, 1 << 30).algorithm in ("nvls_tree", "ring")
    assert all(c.algorithm not in ("nvls", "nvls_tree") for c in m.candidates(DGX_A100, 8, 1, 1 << 30))
    pcie = m.system_from_links("ampere", "pci", 31.5e9, 12.5e9)
    assert all(c.protocol != "LL128" for n in (8, 1 << 20, 1 << 30) for c in m.candidates(pcie, 8, 1, n))


def test_corrections_scale_the_terms_but_not_the_choice() -> None:
    base = NcclTuning(DGX_A100)
    slow = NcclTuning(DGX_A100, Corrections(2.0, 3.0, 1.5, 1.0))
    t0, c0 = m.allreduce_seconds(base, 8, 1, 1 << 20)
    t1, c1 = m.allreduce_seconds(slow, 8, 1, 1 << 20)
    assert c0 == c1
    assert t1 * 1e6 == pytest.approx(2.0 * c0.latency_intra_us + 1.5 * c0.transfer_us)
    assert t0 * 1e6 == pytest.approx(c0.model_us)


def test_native_is_nccl_on_gpu_links_and_gloo_ring_elsewhere() -> None:
    gpu = make_cluster(1, 8, "nvlink-a100")
    est = allreduce_time("native", gpu, 1 << 20)
    assert (est.method, est.nccl) == ("nccl-model", "ring/LL")
    cpu = make_cluster(1, 4, "bw=1GB/s,lat=20us")
    assert allreduce_time("native", cpu, 1 << 20).method == "replay"
    assert allreduce_time("native", gpu, 1 << 20, method="replay").method == "replay"


def test_generation_from_device_names() -> None:
    names = [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA H100 80GB HBM3",
        "Tesla V100-SXM2-16GB",
        "NVIDIA B200",
        "Tesla T4",
    ]
    assert [m.generation_of(n) for n in names] == ["ampere", "hopper", "volta", "blackwell", None]


def test_nvlink5_links_carry_50_gb_s_each_so_a_b200_has_18() -> None:
    """NVLink 5 doubles the link (18 links of 50 GB/s, 900 GB/s per direction; `nvidia-smi topo -m`
    on an HGX B200 shows NV18) and NCCL counts each at topo.h SM100_NVLINK_BW = 40.1 GB/s: 721.8
    GB/s of bus bandwidth, not the 1,443.6 that 25 GB/s links would give. Against nccl-tests
    all_reduce_perf on Blackwell GPUs in one NVLink 5 domain: peak busbw 811 GB/s on 8 GB200s (two
    trays of an NVL72, MNNVL; lixueduan.com/posts/ai/13-gb200-mnnvl-nccl-test) and 835-847 GB/s at
    4-8 GiB on all 72 of a rack (coreweave/nccl-tests#43)."""
    from ringtree.sim.network.clusters import get

    b200 = m.system_for(get("dgx-b200").cluster(1))
    assert b200 is not None and b200.intra_bus_GBps == pytest.approx(18 * 40.1) and b200.channels == 32
    for name, p, n, published in (("dgx-b200", 8, 8 << 30, 811.0), ("gb200-nvl72", 72, 8 << 30, 846.8)):
        system = m.system_for(get(name).cluster(1))
        assert system is not None
        seconds, _ = m.allreduce_seconds(NcclTuning(system), p, 1, n)
        busbw = n / seconds / 1e9 * 2 * (p - 1) / p
        assert busbw == pytest.approx(published, rel=0.12)
