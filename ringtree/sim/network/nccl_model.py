"""NCCL's own all-reduce cost model: the algorithm and protocol it picks per size, and their times.

NCCL prices every (algorithm, protocol) pair as latency + bytes / bandwidth and runs the cheapest
(`ncclTopoTuneModel` and `ncclTopoGetAlgoTime`). The figures below are NCCL's, from
NVIDIA/nccl src/graph/tuning.cc, search.cc and topo.h at commit 5067397 (June 2026); the structure
of the formulas follows that file, written here from its description (docs/simulator.md, "What
NCCL chooses"). Latencies are in microseconds, bandwidths in GB/s, as in NCCL.

What a cluster adds: the GPU generation, whether the node's fabric is NVLink or PCIe, the bus
bandwidth NCCL's topology search finds inside a node (links x per-link figure) and across nodes
(the node's NICs together), and the channel count. `Corrections` scale the latency of each level
and the transfer term; `ringtree calibrate` fits them to nccl-tests logs, while the choice stays
NCCL's (NCCL picks by its model, not by the measured times).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.sim.network.hardware import Cluster
from ringtree.sim.network.nccl_system import GENERATIONS as GENERATIONS  # re-exported: callers of the model
from ringtree.sim.network.nccl_system import Corrections as Corrections
from ringtree.sim.network.nccl_system import NcclSystem as NcclSystem
from ringtree.sim.network.nccl_system import NcclTuning as NcclTuning

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")

# baseLatencies[algorithm][protocol] (tuning.cc)
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)}
# hwLatencies[NVLINK | PCI | NET][algorithm][protocol] (tuning.cc)
HW_LAT = {
    "nvlink": {
        "tree": (0.6, 1.25, 4.0),
        "ring": (0.6, 1.9, 3.4),
        "nvls": (0, 0, 25),
        "nvls_tree": (0, 0, 25),
    },
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {
        "tree": (5.0, 8.5, 14.0),
        "ring": (2.7, 4.0, 14.0),
        "nvls": (0, 0, 18),
        "nvls_tree": (0, 0, 20.9),
    },
}
# llMaxBws: one node by GPU generation; several nodes by CPU vendor (Intel row), N2 and N4+ columns.
LL_MAX_BW = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_BW_NODES = (39.0, 39.0, 20.4)
# Per-channel caps [generation] -> (1 node, 2 nodes, more nodes).
PER_CH_RING_LL128 = {
    "volta": (20.0,) * 3,
    "ampere": (20.0,) * 3,
    "hopper": (36.7,) * 3,
    "blackwell": (40.0,) * 3,
}
PER_CH_TREE_LL128 = {
    "volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0),
}  # fmt: skip
PER_CH_TREE = {
    "volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0), "blackwell": (70.0, 42.8, 24.0),
}  # fmt: skip
PER_CH_NVLS_TREE = {
    "volta": (0.0,) * 3,
    "ampere": (0.0,) * 3,
    "hopper": (0.0, 57.7, 45.5),
    "blackwell": (0.0, 96.0, 80.0),
}
NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
# treeCorrectionFactor[protocol][log2(bytes / 64)] for 64 B .. 256 MiB (tuning.cc).
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)  # fmt: skip
NET_OVERHEAD_US = 1.0  # getNetOverhead on an Intel x86 host (2.0 on AMD); x3 for Simple
NVLINK_BW_PER_LINK = {
    "volta": 20.0,
    "ampere": 20.0,
    "hopper": 20.6,
    "blackwell": 40.1,
}  # topo.h SMxx_NVLINK_BW
# NVLink's datasheet rate per link and direction, GB/s, which the presets' per-GPU NVLink bandwidth
# is a multiple of: NVLink 2-4 (V100, A100, H100) 25, NVLink 5 (B200, GB200) 50 (18 links = 900
# GB/s per direction); NCCL counts each link at its SMxx_NVLINK_BW above
NVLINK_LINK_GBPS = {"volta": 25.0, "ampere": 25.0, "hopper": 25.0, "blackwell": 50.0}
MAX_CHANNELS = 32  # MAXCHANNELS
IB_ALPHA_S = 2e-6  # the InfiniBand presets' latency, what NCCL's NET latencies describe
NCCL_BUFFSIZE = 4 << 20  # DEFAULT_BUFFSIZE: staging buffer per channel and peer (Simple protocol)
# search.cc: per-channel speeds the topology search tries, fastest first (Hopper, Blackwell).
NVLS_SPEEDS_INTRA = {
    "volta": (3.0,), "ampere": (3.0,),
    "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    "blackwell": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}  # fmt: skip
NVLS_SPEEDS_INTER = {
    "volta": (0.12,), "ampere": (0.12,),
    "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
               2.4, 1.2, 0.24, 0.12),
    "blackwell": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0,
                  6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """One (algorithm, protocol) priced NCCL's way, with its latency split by level."""

    algorithm: str
    protocol: str
    latency_intra_us: float
    latency_inter_us: float
    transfer_us: float
    level: str  # which level's bandwidth the transfer term is: intra (1 node) or inter
    fill_us: float = 0.0  # network pipeline fill (`pipeline_fill_us`): in the time, not in NCCL's pick

    @property
    def label(self) -> str:
        return f"{self.algorithm}/{self.protocol}"

    @property
    def model_us(self) -> float:
        """NCCL's own estimate, the one it chooses by."""
        return self.latency_intra_us + self.latency_inter_us + self.transfer_us

    def terms(self) -> tuple[float, float, float, float]:
        """Coefficients of the four corrections: time = terms . corrections."""
        intra = self.level == "intra"
        return (
            self.latency_intra_us,
            self.latency_inter_us,
            self.transfer_us if intra else 0.0,
            0.0 if intra else self.transfer_us + self.fill_us,
        )

    def time_us(self, c: Corrections) -> float:
        t = self.terms()
        return (
            t[0] * c.latency_intra
            + t[1] * c.latency_inter
            + t[2] * c.transfer_intra
            + t[3] * c.transfer_inter
        )


def _log2i(n: int) -> int:
    return n.bit_length() - 1 if n > 0 else -1


def _bus_bandwidth(s: NcclSystem, nodes: int) -> float:
    """busBw of (algorithm, Simple) before the protocol refinements: nChannels x per-channel bw."""
    if nodes == 1:
        return s.intra_bus_GBps
    return min(s.intra_bus_GBps, s.inter_bus_GBps)


def _nvls_graph(s: NcclSystem, ppn: int, nodes: int) -> tuple[int, float, float]:
    """(channels, bwIntra, bwInter) of NCCL's NVLS graph search (search.cc, ncclTopoCompute).

    One channel per GPU of the node (at most NCCL_MAX_NVLS_ARITY, 32); the per-channel speed is
    the first of the generation's speed array that the channels fit in: the GPU's NVLink
    bandwidth, counted x p/(p-1) for non-ring patterns, inside a node; a NIC per channel across
    nodes. On one node the search then raises bwInter one step (pass 2).
    """
    nc = min(32, ppn)
    total = s.intra_bus_GBps * ppn / max(1, ppn - 1)
    speeds = NVLS_SPEEDS_INTRA[s.generation] if nodes == 1 else NVLS_SPEEDS_INTER[s.generation]
    limit = s.intra_bus_GBps if nodes == 1 else min(s.intra_bus_GBps, s.inter_bus_GBps / nc)
    i = next((j for j, v in enumerate(speeds) if v <= limit and v * nc <= total), len(speeds) - 1)
    bw_intra = bw_inter = speeds[i]
    if nodes == 1 and i > 0 and speeds[i - 1] < 2 * bw_intra:
        bw_inter = speeds[i - 1]
    return nc, bw_intra, bw_inter


def _nvls_bus(s: NcclSystem, algorithm: str, ppn: int, nodes: int, col: int) -> float:
    """NVLS and NVLS-tree busBw: the switch reduces, so the fabric carries each byte about half as often."""
    nc, bw_intra, bw_inter = _nvls_graph(s, ppn, nodes)
    intra = bw_intra * NVLS_EFFICIENCY[s.generation] * (nc - 1) / nc * 2.0  # all-reduce pipelines two ops
    if algorithm == "nvls":
        return nc * min(intra, bw_inter)
    inter = bw_inter * (2 if nodes <= 2 else 1)
    return nc * min(intra, inter, PER_CH_NVLS_TREE[s.generation][col])


def bandwidth(s: NcclSystem, algorithm: str, protocol: str, p: int, nodes: int) -> float:
    """Algorithm bandwidth (GB/s) NCCL assigns to an all-reduce; 0 when not available."""
    col = 0 if nodes == 1 else 1 if nodes == 2 else 2
    nc, gen = s.channels, s.generation
    if algorithm in ("nvls", "nvls_tree"):
        usable = s.nvls and protocol == "Simple" and (nodes == 1) == (algorithm == "nvls")
        return _nvls_bus(s, algorithm, p // nodes, nodes, col) * p / (2 * (p - 1)) if usable else 0.0
    if protocol == "LL128" and s.fabric != "nvlink":
        return 0.0  # LL128 is enabled by default only over NVLink
    bus = _bus_bandwidth(s, nodes)
    ll_max = LL_MAX_BW[gen] if nodes == 1 else LL_MAX_BW_NODES[col]
    if algorithm == "ring":
        if protocol == "LL":
            bus = min(ll_max, bus * 0.5)
        elif protocol == "LL128":
            bus = min(bus * 0.92, nc * PER_CH_RING_LL128[gen][col])
        return bus * p / (2 * (p - 1))
    bus = min(bus * 0.92, nc * PER_CH_TREE[gen][col])
    if protocol == "LL":
        bus = min(bus / 3.8, ll_max)
    elif protocol == "LL128":
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), nc * PER_CH_TREE_LL128[gen][col])
    return bus * 0.5


def latency(s: NcclSystem, algorithm: str, protocol: str, p: int, nodes: int) -> tuple[float, float]:
    """(intra-node part, inter-node part) of NCCL's latency for one all-reduce, in us."""
    j = PROTOCOLS.index(protocol)
    ppn = p // nodes
    intra_lat = HW_LAT[s.fabric][algorithm][j]
    inter_lat = HW_LAT["net"]["tree" if ppn == 1 else algorithm][j] + s.net_latency_us
    base = BASE_LAT[algorithm][j]
    if algorithm == "ring":
        nsteps, inter_steps = 2 * (p - 1), 2 * (nodes - 1)
        if nodes > 1:
            intra_lat = max(intra_lat, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
        return base + (nsteps - inter_steps) * intra_lat, inter_steps * inter_lat
    if algorithm == "tree":
        return base + 2 * (ppn - 1) * intra_lat, 2 * _log2i(nodes) * inter_lat
    if algorithm == "nvls":
        return intra_lat, 0.0
    return intra_lat, 2 * _log2i(nodes) * inter_lat  # nvls_tree


def price(s: NcclSystem, algorithm: str, protocol: str, p: int, nodes: int, nbytes: int) -> Choice | None:
    """One candidate priced as ncclTopoGetAlgoTime does, or None where NCCL cannot run it."""
    bw = bandwidth(s, algorithm, protocol, p, nodes)
    if bw <= 0:
        return None
    lat_intra, lat_inter = latency(s, algorithm, protocol, p, nodes)
    log_size = _log2i(nbytes >> 6)
    if algorithm == "tree" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[PROTOCOLS.index(protocol)][log_size]
    if algorithm == "ring" and protocol == "Simple" and nodes > 1 and nbytes // (s.channels * p) >= 64:
        plateau = 1.9 if s.generation == "volta" else 1.4  # "plateau effect of ring"
        lat_intra, lat_inter = lat_intra * plateau, lat_inter * plateau
    level = "intra" if nodes == 1 else "inter"
    fill = pipeline_fill_us(s, algorithm, p, nodes, nbytes, bw) if protocol == "Simple" else 0.0
    return Choice(algorithm, protocol, lat_intra, lat_inter, nbytes / (1000 * bw), level, fill)


def pipeline_fill_us(s: NcclSystem, algorithm: str, p: int, nodes: int, nbytes: int, bw: float) -> float:
    """Time a tree across nodes takes to fill its network pipeline before it streams at `bw`, in us.

    A tree reduces up to the root before the broadcast comes down, and across nodes NCCL's proxy
    stages each channel's Simple-protocol data in a buffer of NCCL_BUFFSIZE (4 MiB) per peer: the
    first min(n, channels x buffer) bytes go up before results stream back, so they cost their
    transfer time once more. A ring streams from its first step (no fill); LL and LL128 hand on
    every line as it lands; one node has no network proxy. NCCL's model, which picks the
    algorithm, has no such term: the pick stays NCCL's, the time includes it.
    """
    if nodes == 1 or algorithm not in ("tree", "nvls_tree"):
        return 0.0
    channels = _nvls_graph(s, p // nodes, nodes)[0] if algorithm == "nvls_tree" else s.channels
    return min(nbytes, NCCL_BUFFSIZE * channels) / (1000 * bw)


def candidates(s: NcclSystem, p: int, nodes: int, nbytes: int) -> list[Choice]:
    """Every (algorithm, protocol) NCCL would consider for this all-reduce, cheapest first."""
    if p < 2 or p % nodes:
        raise ValueError(f"need at least 2 ranks, evenly over nodes; got {p} ranks on {nodes} nodes")
    priced = [price(s, a, q, p, nodes, nbytes) for a in ALGORITHMS for q in PROTOCOLS]
    return sorted((c for c in priced if c is not None), key=lambda c: c.model_us)


def choose(s: NcclSystem, p: int, nodes: int, nbytes: int) -> Choice:
    """NCCL's pick: the candidate with the smallest modelled time."""
    return candidates(s, p, nodes, nbytes)[0]


def allreduce_seconds(tuning: NcclTuning, p: int, nodes: int, nbytes: int) -> tuple[float, Choice]:
    """Corrected time of NCCL's pick, and the pick."""
    if nbytes <= 0 or p < 2:
        return 0.0, Choice("none", "none", 0.0, 0.0, 0.0, "intra")
    choice = choose(tuning.system, p, nodes, nbytes)
    return choice.time_us(tuning.corrections) * 1e-6, choice


def crossovers(
    s: NcclSystem, p: int, nodes: int, lo: int = 8, hi: int = 1 << 33
) -> list[tuple[int, str, str]]:
    """(first size of the new pick, old label, new label) for every change of pick in [lo, hi]."""
    out: list[tuple[int, str, str]] = []
    prev_size, prev = lo, choose(s, p, nodes, lo).label
    size = lo
    while size < hi:
        size = min(size * 2, hi)
        label = choose(s, p, nodes, size).label
        if label != prev:
            a, b = prev_size, size  # choose(a) == prev, choose(b) != prev: bisect
            while b - a > max(1, a // 1000):
                mid = (a + b) // 2
                a, b = (mid, b) if choose(s, p, nodes, mid).label == prev else (a, mid)
            out.append((b, prev, choose(s, p, nodes, b).label))
            prev = choose(s, p, nodes, b).label
        prev_size = size
    return out


def generation_of(name: str) -> str | None:
    """GPU generation from a device or preset name (A100 -> ampere, H100/H200/H800 -> hopper, ...)."""
    n = name.lower()
    for keys, gen in (
        (("b100", "b200", "gb200", "b300", "gb300"), "blackwell"),
        (("h100", "h200", "h800", "h20", "gh200"), "hopper"),
        (("a100", "a800", "a30"), "ampere"),
        (("v100",), "volta"),
    ):
        if any(k in n for k in keys):
            return gen
    return None


def system_for(cluster: Cluster) -> NcclSystem | None:
    """NCCL's view of a cluster whose intra link is an NVLink or PCIe preset (a GPU cluster), else None."""
    name = cluster.intra.name.lower()
    if "nvlink" in name:
        fabric = "nvlink"
    elif "pcie" in name or "pci" in name:
        fabric = "pci"
    else:
        return None
    gen = generation_of(name) or "ampere"
    return system_from_links(
        gen,
        fabric,
        cluster.intra.bandwidth_Bps,
        cluster.inter.bandwidth_Bps * cluster.nics_per_node,
        cluster.inter.alpha_s,
    )


def system_from_links(
    gen: str, fabric: str, intra_Bps: float, inter_Bps: float, nic_alpha_s: float = IB_ALPHA_S
) -> NcclSystem:
    """NCCL's bus bandwidths from datasheet link rates, and the NIC's latency beyond InfiniBand's.

    NVLink: the links are the datasheet bandwidth over the generation's per-link rate
    (`NVLINK_LINK_GBPS`: 12 of 25 GB/s on an A100, 18 of 25 on an H100, 18 of 50 on a B200), each
    counted at NCCL's figure (topo.h SMxx_NVLINK_BW: 20 for an A100 link, 20.6 for Hopper's, 40.1
    for NVLink 5's), and NCCL runs two channels per link up to 32. PCIe: PCI_BW 12 GB/s for a Gen3 x16
    of 15.75, so 0.76, on 2 channels. NICs at their line rate. NCCL's NET latencies describe
    InfiniBand (`IB_ALPHA_S`, the ib-hdr/ib-ndr presets' 2 us): a slower NIC (EFA's 15 us) adds
    the difference to every inter-node step.
    """
    if fabric == "nvlink":
        per_link = NVLINK_BW_PER_LINK[gen]
        bus = intra_Bps / 1e9 / NVLINK_LINK_GBPS[gen] * per_link
        channels = min(MAX_CHANNELS, 2 * max(1, round(bus / per_link)))
    else:
        bus, channels = intra_Bps / 1e9 * 12.0 / 15.75, 2
    nvls = fabric == "nvlink" and gen in ("hopper", "blackwell")
    extra_us = max(0.0, (nic_alpha_s - IB_ALPHA_S) * 1e6)
    return NcclSystem(gen, fabric, bus, inter_Bps / 1e9, channels, nvls, extra_us)


def tuning_for(cluster: Cluster) -> NcclTuning | None:
    """The cluster's own (calibrated) tuning, else NCCL's uncorrected view of it, else None."""
    if cluster.nccl is not None:
        return cluster.nccl
    system = system_for(cluster)
    return NcclTuning(system) if system is not None else None
