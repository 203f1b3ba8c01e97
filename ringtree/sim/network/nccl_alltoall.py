"""NCCL's all-to-all: grouped point-to-point sends and receives, NVLink inside a node, PXN across.

NCCL has no all-to-all algorithm of its own: nccl-tests' alltoall_perf (and torch's
`all_to_all_single`) post one send and one receive per peer between `ncclGroupStart` and
`ncclGroupEnd`, and NCCL runs them all at once on its point-to-point channels (no ring, no tree,
none of the all-reduce tuning model). So the time is a latency plus the busiest resource's bytes
over its bandwidth:

  * inside a node (an NVLink domain: `gpus_per_node` GPUs, 72 on an NVL72 rack) every GPU sends
    n (L-1)/p of its n bytes through its own NVLink port at the bus bandwidth NCCL's topology
    search finds (`NcclSystem.intra_bus_GBps`: links x NCCL's per-link figure, 370 GB/s on an
    H100, which NCCL's developers quote as the NVLink bandwidth non-all-reduce collectives reach);
  * across nodes PXN (NCCL_PXN_DISABLE=0, the default) sends a message for local rank j of a
    remote node from local GPU j over NVLink, then out of NIC j ("rail-aligned"), so a node's L
    GPUs put L n (p-L)/p bytes on its NICs together (`inter_bus_GBps`), and each GPU forwards the
    (L-1)/L of its remote bytes that belong to other rails over NVLink on top of its own local ones.
    Both levels stream at once: the slower one sets the time.

Latency: a point-to-point operation pays NCCL's ring latencies for one step (base plus the
fabric's hardware latency; LL up to NCCL_P2P_LL_THRESHOLD bytes per peer, Simple above), once per
round of peers (NCCL drives MAX_P2P_PEERS peers at once, over 2 channels each); remote peers add the
network's step latency per round of the node's remote peers. The four terms (latency and transfer
per level) take the same `Corrections` as the all-reduce model, fitted by `ringtree calibrate` to
alltoall_perf logs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ringtree.sim.network.curve import Curve
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.network.nccl_model import BASE_LAT, HW_LAT
from ringtree.sim.network.nccl_system import Corrections, NcclSystem, NcclTuning

P2P_LL_THRESHOLD = 16384  # NCCL_P2P_LL_THRESHOLD: bytes per peer up to which p2p runs LL
MAX_P2P_PEERS = 16  # peers in flight at once: NCCL's 32 p2p channels, 2 per peer


@dataclass(frozen=True)
class Price:
    """An all-to-all priced NCCL's way: latency and transfer per level, microseconds."""

    protocol: str
    latency_intra_us: float
    latency_inter_us: float
    transfer_intra_us: float
    transfer_inter_us: float

    @property
    def level(self) -> str:
        """Which level's transfer sets the time: the NVLink ports (intra) or the NICs (inter)."""
        return "inter" if self.transfer_inter_us > self.transfer_intra_us else "intra"

    def terms(self, c: Corrections | None = None) -> tuple[float, float, float, float]:
        """Coefficients of the four corrections: time = terms . corrections (the slower level's
        transfer only, the levels streaming at once); with `c`, the level slower once corrected."""
        c = c or Corrections()
        inter = self.transfer_inter_us * c.transfer_inter > self.transfer_intra_us * c.transfer_intra
        return (
            self.latency_intra_us,
            self.latency_inter_us,
            0.0 if inter else self.transfer_intra_us,
            self.transfer_inter_us if inter else 0.0,
        )

    def time_us(self, c: Corrections) -> float:
        t = self.terms(c)
        return (
            t[0] * c.latency_intra
            + t[1] * c.latency_inter
            + t[2] * c.transfer_intra
            + t[3] * c.transfer_inter
        )


def intra_bandwidth_GBps(s: NcclSystem) -> float:
    """One GPU's point-to-point bandwidth into its node's fabric, as NCCL counts it (GB/s): the
    system's bus figure, its links x NCCL's per-link figure (`nccl_model.system_from_links`)."""
    return s.intra_bus_GBps


def price(s: NcclSystem, p: int, nodes: int, nbytes: int) -> Price:
    """NCCL's all-to-all of `nbytes` per rank (nccl-tests' size) over p ranks on `nodes` nodes."""
    if p < 2 or p % nodes:
        raise ValueError(f"need at least 2 ranks, evenly over nodes; got {p} ranks on {nodes} nodes")
    local = p // nodes
    remote = p - local
    block = nbytes / p  # what one rank sends each peer
    protocol = "LL" if block <= P2P_LL_THRESHOLD else "Simple"
    j = 0 if protocol == "LL" else 2
    rounds = -(-(p - 1) // MAX_P2P_PEERS)
    fabric_lat = HW_LAT[s.fabric]["ring"][j] if local > 1 else 0.0
    latency_intra = BASE_LAT["ring"][j] + rounds * fabric_lat
    latency_inter = 0.0
    if remote:
        net_rounds = -(-remote // MAX_P2P_PEERS)
        latency_inter = net_rounds * (HW_LAT["net"]["ring"][j] + s.net_latency_us)
    own = block * (local - 1)
    forwarded = block * remote * (local - 1) / local  # PXN: other rails' bytes over NVLink first
    transfer_intra = (own + forwarded) / (1000 * intra_bandwidth_GBps(s)) if local > 1 else 0.0
    transfer_inter = local * block * remote / (1000 * s.inter_bus_GBps) if remote else 0.0
    return Price(protocol, latency_intra, latency_inter, transfer_intra, transfer_inter)


def seconds(tuning: NcclTuning, p: int, nodes: int, nbytes: int) -> tuple[float, Price | None]:
    """Corrected seconds of NCCL's all-to-all, and its price (None when nothing moves).

    Where a calibration logged this node shape (`NcclTuning.alltoall_rows`), the corrected model
    times the logged rows' measured / corrected ratio, interpolated log-log between the two nearest
    sizes (the nearest row's outside them): every logged size comes back as measured.
    """
    if nbytes <= 0 or p < 2:
        return 0.0, None
    priced = price(tuning.system, p, nodes, nbytes)
    model = priced.time_us(tuning.alltoall) * 1e-6
    rows = sorted(
        (n, s) for k, per_node, n, s in tuning.alltoall_rows if (k, per_node) == (nodes, p // nodes)
    )
    if not rows:
        return model, priced
    sizes, times = zip(*rows, strict=True)
    curve = Curve("native", nodes, p // nodes, sizes, times, (0.0,) * len(rows))
    fit = functools.partial(_corrected_s, tuning, p, nodes)
    return curve.corrected(nbytes, fit), priced


def reads_rows(tuning: NcclTuning, p: int, nodes: int) -> bool:
    """Whether a calibration logged all-to-alls at this GPU count and node shape."""
    return any((k, per_node) == (nodes, p // nodes) for k, per_node, _, _ in tuning.alltoall_rows)


def _corrected_s(tuning: NcclTuning, p: int, nodes: int, nbytes: int) -> float:
    return price(tuning.system, p, nodes, nbytes).time_us(tuning.alltoall) * 1e-6


def cluster_seconds(tuning: NcclTuning, cluster: Cluster, nbytes: int) -> float:
    """`seconds` on a cluster's ranks and nodes."""
    return seconds(tuning, cluster.ranks, cluster.nodes, nbytes)[0]


__all__ = ["Price", "cluster_seconds", "intra_bandwidth_GBps", "price", "reads_rows", "seconds"]
