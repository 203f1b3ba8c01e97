"""The hardware model: links with latency and bandwidth, and a cluster of nodes joined by NICs.

A cluster is `nodes` nodes of `gpus_per_node` devices. Inside a node every device has its own
port into the node's fabric (PCIe switch, NVLink) with the `intra` link's bandwidth in each
direction; between nodes, every node has `nics_per_node` NICs of the `inter` link's bandwidth on a
non-blocking switch, and device j uses NIC j mod nics_per_node (a "rail"). Reductions cost
`gamma` seconds per reduced byte on the receiving device.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ringtree.sim.network.nccl_system import NcclTuning
from ringtree.topology import LinkLevel, Topology


@dataclass(frozen=True)
class Link:
    """One kind of link: `alpha_s` seconds per message, `bandwidth_Bps` bytes/s in each direction."""

    name: str
    alpha_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bandwidth_Bps <= 0:
            raise ValueError(
                f"link {self.name!r}: need latency >= 0 and bandwidth > 0, "
                f"got {self.alpha_s} s and {self.bandwidth_Bps} B/s"
            )

    @property
    def beta(self) -> float:
        """Seconds per byte at full bandwidth."""
        return 1.0 / self.bandwidth_Bps

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MeasuredRows(Protocol):
    """A calibration's measured all-reduce times as the planner reads them; implemented by
    `ringtree.sim.network.measured.MeasuredTimes` (declared here so that the hardware model imports no
    model)."""

    def seconds(self, algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float: ...

    def residual(self, algorithm: str, cluster: Cluster, nbytes: int) -> float | None: ...

    def describe(self, algorithm: str, cluster: Cluster, nbytes: int) -> str: ...

    def reads(self, algorithm: str, cluster: Cluster) -> bool:
        """Whether rows of `algorithm` were measured at the cluster's GPU count and node shape."""
        ...


@dataclass(frozen=True)
class Cluster:
    """Nodes x devices, an intra-node and an inter-node link, NICs per node, and reduction cost."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    gamma: float = 5e-12  # a GPU sums about 200 GB/s of fp32 (reads two, writes one operand)
    nics_per_node: int = 1
    # NCCL's view of a GPU cluster with calibrated corrections (ringtree.sim.network.nccl_model); None:
    # derived from the link presets when the cluster is a GPU one.
    nccl: NcclTuning | None = None
    # A calibration's measured all-reduce rows (ringtree.sim.network.measured): the planner reads its
    # all-reduce times off them at the planned size. None: the closed form on the links.
    measured: MeasuredRows | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"need at least one node and one device per node, got nodes={self.nodes} "
                f"gpus_per_node={self.gpus_per_node}"
            )
        if self.nics_per_node < 1 or self.gamma < 0:
            raise ValueError(
                f"need nics_per_node >= 1 and gamma >= 0, got {self.nics_per_node} and {self.gamma}"
            )

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def topology(self) -> Topology:
        return Topology(self.ranks, self.gpus_per_node)

    def link(self, level: LinkLevel) -> Link:
        return self.intra if level is LinkLevel.INTRA else self.inter

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)

    def network(self) -> dict[str, Any]:
        """What each node is assumed to have: its GPUs and their link, its NICs and each NIC's speed."""
        return {
            "gpus_per_node": self.gpus_per_node,
            "intra": self.intra.name,
            "nics_per_node": self.nics_per_node,
            "nic": self.inter.name,
            "nic_GBps": self.inter.bandwidth_Bps / 1e9,
        }

    def per_node(self) -> str:
        """`network()` in words: '8 GPUs (nvlink-a100) and 1 x eth-10g (1.25 GB/s each) per node'."""
        return (
            f"{self.gpus_per_node} GPUs ({self.intra.name}) and {self.nics_per_node} x {self.inter.name} "
            f"({self.inter.bandwidth_Bps / 1e9:.3g} GB/s each) per node"
        )

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, measured=None))
        out["measured"] = self.measured is not None  # the rows themselves are in the calibration file
        return out


_BANDWIDTH_UNITS = {"gb/s": 1e9, "gbps": 1e9 / 8, "gbit/s": 1e9 / 8, "mb/s": 1e6, "mbit/s": 1e6 / 8}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_link(spec: str, presets: dict[str, Link]) -> Link:
    """A link from a preset name, a JSON file, or 'bw=12.5GB/s,lat=5us' (bw also in Gbit/s)."""
    if spec in presets:
        return presets[spec]
    if spec.endswith(".json"):
        return link_from_json(Path(spec))
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if set(fields) != {"bw", "lat"}:
        raise ValueError(
            f"unknown link {spec!r}: use a preset ({', '.join(presets)}), a .json file, "
            "or custom values like 'bw=12.5GB/s,lat=5us'"
        )
    return Link(spec, _quantity(fields["lat"], _TIME_UNITS), _quantity(fields["bw"], _BANDWIDTH_UNITS))


def link_from_json(path: Path) -> Link:
    """A link from {"name", "alpha_s", "bandwidth_Bps"} in a JSON file."""
    from ringtree import files  # (here, not at the top: keeps this hunk apart from the imports)

    data = files.read_json(path)
    try:
        return Link(str(data.get("name", path.stem)), float(data["alpha_s"]), float(data["bandwidth_Bps"]))
    except KeyError as e:
        raise ValueError(f"{path}: a link file needs keys alpha_s and bandwidth_Bps, missing {e}") from None


def _quantity(text: str, units: dict[str, float]) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in units:
        raise ValueError(f"cannot read {text!r}; write a number with one of the units {', '.join(units)}")
    return float(m.group(1)) * units[unit]
