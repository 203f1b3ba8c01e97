"""All-to-all in the simulator: NCCL's grouped point-to-point model and the algorithms' closed forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim import INTER, INTRA, Cluster, Link
from ringtree.sim.network.alltoall import ALGORITHMS, alltoall_seconds, alltoall_time, estimate, replay
from ringtree.sim.network.alltoall_form import bruck_blocks
from ringtree.sim.network.clusters import CLUSTERS
from ringtree.sim.network.nccl_alltoall import price
from ringtree.sim.network.nccl_model import tuning_for

MiB = 1 << 20


def test_bruck_blocks_count_the_distances_with_the_bit_set() -> None:
    for p in (2, 3, 5, 8, 12, 100):
        for i in range((p - 1).bit_length()):
            assert bruck_blocks(p, i) == sum(1 for k in range(1, p) if k >> i & 1), (p, i)


def test_closed_forms_are_the_textbook_ones_on_one_level() -> None:
    """One node, no sharing: the formulas of the module docstring."""
    link = INTRA["pcie-gen4"]
    c = Cluster(1, 8, link, link)
    n, p = 8 * MiB, 8
    b = n / p
    a, beta = link.alpha_s, link.beta
    assert estimate("linear", c, n, 1) == pytest.approx(a + (p - 1) * b * beta)
    assert estimate("pairwise", c, n, 1) == pytest.approx((p - 1) * (a + b * beta))
    assert estimate("bruck", c, n, 1) == pytest.approx(3 * a + 12 * b * beta)  # 4 + 4 + 4 blocks
    assert estimate("hierarchical", c, n, 1) == pytest.approx(a + (p - 1) * b * beta)


def test_hierarchical_moves_the_same_network_bytes_in_larger_messages() -> None:
    """8 nodes of 8 on one NIC each: linear sends 8 x 56 messages of b through a NIC, the
    hierarchical exchange 8 x 7 messages of 8 b: the same bytes, plus a step over NVLink."""
    c = Cluster(8, 8, INTRA["nvlink-h100"], INTER["eth-10g"])
    n = 256 * MiB
    intra = INTRA["nvlink-h100"].alpha_s + 7 * n / 8 * INTRA["nvlink-h100"].beta
    assert estimate("hierarchical", c, n) == pytest.approx(estimate("linear", c, n) + intra)


def test_native_on_one_node_streams_at_nccls_nvlink_figure() -> None:
    """8 x H100: busbw tends to 18 links x 20.6 GB/s (NCCL's effective NVLink bandwidth)."""
    c = CLUSTERS["dgx-h100"].cluster(1)
    n = 1 << 30
    t = alltoall_seconds(c, n)
    assert n / t * 7 / 8 / 1e9 == pytest.approx(18 * 20.6, rel=0.01)


def test_native_across_nodes_is_bound_by_one_nic_per_gpu() -> None:
    """Many DGX H100 nodes: each GPU's remote bytes leave through its own 400 Gb/s NIC (PXN)."""
    c = CLUSTERS["dgx-h100"].cluster(64)
    n = 1 << 30
    p = c.ranks
    t = alltoall_seconds(c, n)
    assert n * (p - 8) / p / t / 1e9 == pytest.approx(50, rel=0.03)  # less the latency
    tuning = tuning_for(CLUSTERS["dgx-h100"].cluster(2))
    assert tuning is not None and price(tuning.system, 16, 2, n).level == "inter"


def test_an_nvlink_domain_prices_its_traffic_on_nvlink() -> None:
    """72 GPUs in one NVLink domain are far faster than 9 nodes of 8 with the same GPUs."""
    rack = Cluster(1, 72, INTRA["nvlink-h100"], INTER["ib-ndr"], nics_per_node=72)
    nodes = Cluster(9, 8, INTRA["nvlink-h100"], INTER["ib-ndr"], nics_per_node=8)
    assert alltoall_seconds(rack, 256 * MiB) < alltoall_seconds(nodes, 256 * MiB) / 4


def test_native_off_gpus_is_the_linear_exchange() -> None:
    c = Cluster(2, 4, Link("shm", 1e-6, 10e9), INTER["eth-10g"])
    est = alltoall_time("native", c, 4 * MiB, "closed-form")
    assert est.method == "closed-form"
    assert est.seconds == estimate("linear", c, 4 * MiB)


def test_nothing_to_move_costs_nothing() -> None:
    c = CLUSTERS["dgx-h100"].cluster(2)
    assert alltoall_seconds(c, 0) == 0.0
    assert alltoall_seconds(Cluster(1, 1, INTRA["nvlink-h100"], INTER["ib-ndr"]), 1 << 20) == 0.0
    with pytest.raises(ValueError, match="unknown all-to-all algorithm"):
        alltoall_seconds(c, 1024, "ring")


# (nodes, GPUs per node): 8 to 64 ranks, powers of two and not, one or several NICs per node
SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1), (1, 12), (3, 4), (2, 3), (4, 8), (8, 8), (16, 4)]


@pytest.mark.parametrize(("nodes", "local"), SHAPES)
def test_closed_form_equals_replay(nodes: int, local: int) -> None:
    """Every algorithm's closed form equals the replay of the executor's schedule (within 0.1%)."""
    for nics in sorted({1, local}):
        c = Cluster(nodes, local, INTRA["pcie-gen4"], INTER["eth-25g"], nics_per_node=nics)
        for algorithm in ALGORITHMS:
            for nbytes in (4096 * c.ranks, MiB * c.ranks // 8, 16 * MiB):
                closed, replayed = estimate(algorithm, c, nbytes), replay(algorithm, c, nbytes)
                assert closed == pytest.approx(replayed, rel=1e-3), (algorithm, nics, nbytes)


def test_closed_form_equals_replay_at_256_ranks() -> None:
    """32 DGX-like nodes: NVLink inside, a NIC per GPU across (the closed form is exact here too)."""
    c = Cluster(32, 8, INTRA["nvlink-h100"], INTER["ib-ndr"], nics_per_node=8)
    for algorithm in ("linear", "pairwise"):
        n = MiB * 16
        assert estimate(algorithm, c, n) == pytest.approx(replay(algorithm, c, n), rel=1e-3), algorithm


def test_closed_forms_run_at_4096_ranks() -> None:
    """512 nodes of 8: every closed form in well under a second; at 64 KiB per rank the two-hop
    exchange ties linear (one latency a step in the model) and Bruck's log steps beat pairwise."""
    c = Cluster(512, 8, INTRA["nvlink-h100"], INTER["ib-ndr"], nics_per_node=8)
    n = 4096 * 16
    times = {a: estimate(a, c, n) for a in ALGORITHMS}
    assert times["bruck"] < times["pairwise"]
    assert times["linear"] < times["pairwise"]
    assert all(t > 0 for t in times.values())


def test_sim_sweep_json_is_the_contract(tmp_path: Path) -> None:
    """`ringtree sim --collective all-to-all --sweep sizes` rows: algorithm, bytes, time_s (and the rest)."""
    out = tmp_path / "a2a.json"
    args = ["sim", "--cluster", "dgx-h100", "--nodes", "2", "--collective", "all-to-all", "--algorithm"]
    args += ["native", "--sweep", "sizes", "--min-bytes", "1M", "--max-bytes", "1G", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [MiB << (2 * i) for i in range(6)]
    assert all(r["algorithm"] == "native" and r["collective"] == "all-to-all" for r in rows)
    c = CLUSTERS["dgx-h100"].cluster(2)
    assert [r["time_s"] for r in rows] == [alltoall_seconds(c, r["bytes"]) for r in rows]
    assert rows[-1]["busbw_gbps"] == pytest.approx(rows[-1]["algbw_gbps"] * 15 / 16)


def test_sim_all_to_all_algorithms_and_bad_input(tmp_path: Path) -> None:
    base = ["sim", "--intra", "pcie-gen4", "--inter", "eth-25g", "--nodes", "2", "--gpus-per-node", "4"]
    result = CliRunner().invoke(app, [*base, "--collective", "all-to-all", "--algorithm", "all"])
    assert result.exit_code == 0, result.output
    assert all(a in result.output for a in ALGORITHMS)
    for extra, words in (
        (["--collective", "all-to-all", "--algorithm", "ring"], "unknown all-to-all algorithm"),
        (["--collective", "all-gather"], "unknown --collective"),
        (["--collective", "all-to-all", "--method", "replay", "--nodes", "128"], "at most 256"),
    ):
        result = CliRunner().invoke(app, [*base, *extra])
        assert result.exit_code == 2 and words in result.output, result.output
