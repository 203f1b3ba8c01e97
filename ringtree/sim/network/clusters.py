"""Cluster presets: GPUs per node, the GPU, the intra-node fabric and the NICs of known machines.

Every figure is a vendor's public one (sources in docs/simulator.md, "Cluster presets"). Peak
TFLOP/s are dense (no structured sparsity). Link bandwidths are per direction; a node with several
NICs ("rails") has device j use NIC j mod nics, as `ringtree.sim.network.hardware` models it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.network.presets import GB, GBIT, INTER, INTRA


@dataclass(frozen=True)
class GPU:
    """One accelerator: dense peak TFLOP/s per dtype, memory and its bandwidth."""

    name: str
    peak_tflops: dict[str, float]  # fp32 (no tensor cores), tf32, fp16, bf16
    memory_GB: float
    hbm_GBps: float
    sms: int = 108  # streaming multiprocessors: a GEMM of fewer output tiles leaves some idle
    # the best bf16 matmul measured over shapes (MAMF) over the dense peak: Bekman, ml-engineering,
    # compute/accelerator "Maximum Achievable Matmul FLOPS comparison table" (A100 SXM 267.9 of 312)
    matmul_share: float = 0.859
    # FlashAttention-2's share of compute.FLASH_EFFICIENCY on this GPU: 1 on Ampere, for which it was
    # written; on Hopper it "achieves only 35% utilization on the H100 GPU" (Shah et al. 2024,
    # FlashAttention-3, abstract) against the 60% it reaches on an A100: 0.35 / 0.6
    flash2_share: float = 1.0
    arch: str = "ampere"  # volta, turing, ampere, hopper or blackwell: which FP8 recipes it runs

    def peak(self, dtype: str) -> float:
        """FLOP/s at the dtype's dense peak; a GPU without bf16 (V100, T4) runs it as fp32."""
        return self.peak_tflops.get(dtype, self.peak_tflops["fp32"]) * 1e12

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (Hopper and Blackwell)."""
        return "fp8" in self.peak_tflops


@dataclass(frozen=True)
class ClusterPreset:
    """A machine type: what each node holds and how nodes connect."""

    name: str
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Link
    nics_per_node: int
    source: str

    def cluster(self, nodes: int) -> Cluster:
        return Cluster(nodes, self.gpus_per_node, self.intra, self.inter, nics_per_node=self.nics_per_node)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


A100_40 = GPU("a100-sxm4-40gb", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 40, 1555)
A100_80 = GPU("a100-sxm4-80gb", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 80, 2039)
# MAMF shares (matmul_share): H100 SXM 792.1 of 989 (80.1%); H200 as H100 (the same tensor cores);
# B200 SXM 1745.0 of 2250 (77.6%), ml-engineering's Blackwell MAMF table
# FP8 dense peaks: H100/H200/H800 SXM 1,979 TFLOP/s (the datasheets' 3,958 with sparsity, halved);
# B200 4,500 (HGX B200: 72 PFLOPS FP8 with sparsity for 8 GPUs, halved); GB200 5,000 (GB200 NVL72:
# 720 PFLOPS FP8 with sparsity for 72 GPUs, halved)
_H100_TFLOPS = {"fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1979}
_FA2_ON_HOPPER = 0.35 / 0.6
H100 = GPU("h100-sxm5-80gb", _H100_TFLOPS, 80, 3350, 132, 0.801, _FA2_ON_HOPPER, "hopper")
H200 = GPU("h200-sxm-141gb", _H100_TFLOPS, 141, 4800, 132, 0.801, _FA2_ON_HOPPER, "hopper")
# H800 SXM: the H100 SXM's compute and memory, NVLink cut to 400 GB/s (DeepSeek-V3 report, 3.1)
H800 = GPU("h800-sxm5-80gb", _H100_TFLOPS, 80, 3350, 132, 0.801, _FA2_ON_HOPPER, "hopper")
# Meta's Grand Teton H100 as torchtitan benchmarked it (docs/performance.md): "96GB HBM2e with 2.4
# TB/sec", "the default 500W power limit"; "the actual peak TFLOPs number is between SXM and NVL" (H100
# NVL datasheet: 1,671 TFLOP/s BF16 with sparsity, 835.5 dense): the midpoint of the two, 912.5
_H100_500W_TFLOPS = {"fp32": 61.8, "tf32": 456, "fp16": 912.5, "bf16": 912.5, "fp8": 1825}
H100_96_500W = GPU(
    "h100-sxm-96gb-hbm2e-500w", _H100_500W_TFLOPS, 96, 2400, 132, 0.801, _FA2_ON_HOPPER, "hopper"
)
# FlashAttention-2 on Blackwell: taken as on Hopper (it uses neither generation's new tensor-core path)
B200 = GPU(
    "b200-sxm-180gb",
    {"fp32": 75, "tf32": 1125, "fp16": 2250, "bf16": 2250, "fp8": 4500},
    180,
    8000,
    148,
    0.776,
    _FA2_ON_HOPPER,
    "blackwell",
)
# GB200 NVL72, per GPU: 2.5 PFLOPS dense BF16 (the datasheet's 360 PFLOPS FP16/BF16 with sparsity
# for 72 GPUs, halved), 186 GB of HBM3e at 8 TB/s (13.4 TB and 576 TB/s for the rack, / 72), FP32 80
# (5,760 TFLOPS for the rack); the B200's SMs. Its matmul share: the same die as the B200 at a higher
# power limit reaches GB200_OVER_B200 times the B200's best matmul (1,745 TFLOP/s), not the peaks'
# 2.5 / 2.25: Megatron-Bridge's dense Llama 3 8B (FP8-CS, the same layout on 8 GPUs) runs at 1,614
# against 1,544 model TFLOP/s per GPU (25.09) and 1,622 against 1,576 (25.11), GB200 against B200
GB200_OVER_B200 = (1614 / 1544 + 1622 / 1576) / 2
GB200 = GPU(
    "gb200-186gb",
    {"fp32": 80, "tf32": 1250, "fp16": 2500, "bf16": 2500, "fp8": 5000},
    186,
    8000,
    148,
    1745.0 * GB200_OVER_B200 / 2500,
    _FA2_ON_HOPPER,
    "blackwell",
)
V100_32 = GPU("v100-sxm2-32gb", {"fp32": 15.7, "fp16": 125}, 32, 900)
V100_PCIE = GPU("v100-pcie-32gb", {"fp32": 14, "fp16": 112}, 32, 900)
T4 = GPU("t4", {"fp32": 8.1, "fp16": 65}, 16, 320)

_EFA_100G = Link("efa-100g", 15e-6, 100 * GBIT)
_ETH_50G = Link("eth-50g", 15e-6, 50 * GBIT)
_NVLINK5 = Link("nvlink-b200", 1e-6, 900 * GB)  # NVLink 5: 1.8 TB/s per GPU, both directions
_ROCE_400G = Link("rdma-400g", 2e-6, 400 * GBIT)  # Grand Teton's backend RDMA, 400 Gb/s per GPU
_EFA_400G_RAIL = Link("efa-4x100g", 15e-6, 400 * GBIT)  # four 100 Gbit/s EFA cards per GPU
_NVLINK5_GB200 = Link("nvlink-gb200", 1e-6, 900 * GB)  # NVLink 5 through the rack's NVLink switches
_NVLINK_H800 = Link("nvlink-h800", 1e-6, 200 * GB)  # H800: 400 GB/s per GPU, both directions

CLUSTERS: dict[str, ClusterPreset] = {
    p.name: p
    for p in (
        ClusterPreset(
            "dgx-a100", 8, A100_80, INTRA["nvlink-a100"], INTER["ib-hdr"], 8,
            "NVIDIA DGX A100 datasheet: 8x A100 80GB, NVSwitch 600 GB/s per GPU, 8x ConnectX-6 HDR 200 Gb/s",
        ),
        ClusterPreset(
            "dgx-h100", 8, H100, INTRA["nvlink-h100"], INTER["ib-ndr"], 8,
            "NVIDIA DGX H100 datasheet: 8x H100 80GB, NVLink 900 GB/s per GPU, 8x ConnectX-7 400 Gb/s",
        ),
        ClusterPreset(
            "p4d.24xlarge", 8, A100_40, INTRA["nvlink-a100"], _EFA_100G, 4,
            "AWS EC2 P4 page: 8x A100 40GB, NVSwitch 600 GB/s, 400 Gbps EFA (4 x 100 Gbps)",
        ),
        ClusterPreset(
            "p5.48xlarge", 8, H100, INTRA["nvlink-h100"], _EFA_400G_RAIL, 8,
            "AWS EC2 P5 page: 8x H100 80GB, NVSwitch 900 GB/s, 3200 Gbps EFAv2 (32 x 100 Gbps)",
        ),
        ClusterPreset(
            "p3dn.24xlarge", 8, V100_32, INTRA["nvlink-v100"], _EFA_100G, 1,
            "AWS EC2 P3 page: 8x V100 32GB, NVLink 300 GB/s per GPU, 100 Gbps EFA",
        ),
        ClusterPreset(
            "g4dn.12xlarge", 4, T4, INTRA["pcie-gen3"], _ETH_50G, 1,
            "AWS EC2 G4 page: 4x T4 16GB on PCIe 3.0, 50 Gbps networking",
        ),
        ClusterPreset(
            "eth-10g", 8, V100_PCIE, INTRA["pcie-gen3"], INTER["eth-10g"], 1,
            "the first seed's cluster: 8 GPUs per node on PCIe, 10 Gbit/s Ethernet (GPU assumed: V100 PCIe)",
        ),
        ClusterPreset(
            "dgx-h200", 8, H200, INTRA["nvlink-h100"], INTER["ib-ndr"], 8,
            "NVIDIA DGX H200 datasheet: 8x H200 141GB (4.8 TB/s), NVLink 900 GB/s per GPU, "
            "8x ConnectX-7 400 Gb/s",
        ),
        ClusterPreset(
            "dgx-b200", 8, B200, _NVLINK5, INTER["ib-ndr"], 8,
            "NVIDIA DGX B200 datasheet: 8x B200 (1,440 GB, 64 TB/s in all), NVLink 5 1.8 TB/s per GPU, "
            "8x ConnectX-7 400 Gb/s",
        ),
        ClusterPreset(
            "gb200-nvl72", 72, GB200, _NVLINK5_GB200, INTER["ib-ndr"], 72,
            "NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs in one NVLink domain (18 compute trays of "
            "4 GPUs, 9 NVLink switch trays), NVLink 5 1.8 TB/s per GPU; one ConnectX-7 400 Gb/s per GPU",
        ),
        ClusterPreset(
            "hgx-h800", 8, H800, _NVLINK_H800, INTER["ib-ndr"], 8,
            "DeepSeek-V3 technical report, 3.1: H800 nodes of 8 GPUs on NVLink and NVSwitch (400 GB/s "
            "per GPU), InfiniBand 400 Gb/s (50 GB/s) per GPU",
        ),
        ClusterPreset(
            "grand-teton-h100", 8, H100_96_500W, INTRA["nvlink-h100"], _ROCE_400G, 8,
            "torchtitan docs/performance.md: Grand Teton, 8 H100 per host with NVLink, 96GB HBM2e at "
            "2.4 TB/s, 500 W power limit, backend RDMA 400 Gb/s per GPU",
        ),
    )
}  # fmt: skip


def get(name: str) -> ClusterPreset:
    """The preset of that name, or a ValueError listing the valid names."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def preset_cluster(
    name: str,
    nodes: int,
    gpus_per_node: int | None = None,
    intra: str | None = None,
    inter: str | None = None,
) -> Cluster:
    """The preset's cluster of `nodes` nodes, with any part the command line names replaced."""
    from ringtree.sim.network.hardware import parse_link

    preset = get(name)
    cluster = preset.cluster(nodes)
    return dataclasses.replace(
        cluster,
        gpus_per_node=gpus_per_node or cluster.gpus_per_node,
        intra=parse_link(intra, INTRA) if intra else cluster.intra,
        inter=parse_link(inter, INTER) if inter else cluster.inter,
        nics_per_node=min(cluster.nics_per_node, gpus_per_node or cluster.nics_per_node),
    )


__all__ = ["CLUSTERS", "GB", "GPU", "ClusterPreset", "get", "preset_cluster"]
