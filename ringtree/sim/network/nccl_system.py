"""What NCCL's topology search finds on a cluster, and the corrections a calibration fits to it.

Data only: the cost model that reads it is `ringtree.sim.network.nccl_model`. It sits below the hardware
model (`ringtree.sim.network.hardware`), whose `Cluster` may carry a calibrated `NcclTuning`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GENERATIONS = ("volta", "ampere", "hopper", "blackwell")


@dataclass(frozen=True)
class NcclSystem:
    """What NCCL's topology search finds: GPU generation, fabric, bus bandwidths, channels."""

    generation: str  # volta | ampere | hopper | blackwell
    fabric: str  # nvlink | pci
    intra_bus_GBps: float  # graph bwIntra x nChannels: one GPU through its node's fabric
    inter_bus_GBps: float  # the node's NICs together (NCCL counts a NIC at line rate / 8)
    channels: int
    nvls: bool = False  # NVLink SHARP (Hopper and later NVSwitch systems)
    # The NIC's one-message latency beyond InfiniBand's, added to every inter-node step: NCCL's
    # NET latencies are InfiniBand figures (EFA: 15 - 2 = 13 us; InfiniBand and RoCE: 0).
    net_latency_us: float = 0.0

    def __post_init__(self) -> None:
        if self.generation not in GENERATIONS or self.fabric not in ("nvlink", "pci"):
            raise ValueError(f"unknown GPU generation {self.generation!r} or fabric {self.fabric!r}")
        if self.intra_bus_GBps <= 0 or self.inter_bus_GBps <= 0 or self.channels < 1:
            raise ValueError("NCCL system: bus bandwidths must be > 0 and channels >= 1")
        if self.net_latency_us < 0:
            raise ValueError(f"NCCL system: net_latency_us must be >= 0, got {self.net_latency_us}")


@dataclass(frozen=True)
class Corrections:
    """Measured / NCCL-model factors: latency of each level, transfer term of each level."""

    latency_intra: float = 1.0
    latency_inter: float = 1.0
    transfer_intra: float = 1.0
    transfer_inter: float = 1.0


@dataclass(frozen=True)
class NcclTuning:
    """A system and the corrections fitted to it, per collective (all 1.0 when uncalibrated)."""

    system: NcclSystem
    corrections: Corrections = field(default_factory=Corrections)
    # the same four factors for all-to-all (`ringtree.sim.network.nccl_alltoall`), fitted to
    # alltoall_perf logs
    alltoall: Corrections = field(default_factory=Corrections)
    # the logs' all-to-all times, (nodes, ranks per node, bytes, seconds): read off at their shape
    alltoall_rows: tuple[tuple[int, int, int, float], ...] = ()
