"""Named link presets, with the public figure each one comes from (sources listed in docs/simulator.md).

Bandwidths are per direction. Latencies are typical one-message software-plus-wire figures, not
datasheet minimums: they matter only for small messages, and `ringtree calibrate` replaces them
with measured values.
"""

from __future__ import annotations

from ringtree.sim.network.hardware import Link

GB = 1e9
GBIT = 1e9 / 8

INTRA: dict[str, Link] = {
    # PCIe x16: 8 / 16 / 32 GT/s per lane with 128b/130b encoding (PCI-SIG).
    "pcie-gen3": Link("pcie-gen3", 2e-6, 15.75 * GB),
    "pcie-gen4": Link("pcie-gen4", 2e-6, 31.5 * GB),
    "pcie-gen5": Link("pcie-gen5", 2e-6, 63.0 * GB),
    # NVLink: the datasheets' total bidirectional figure, halved (300, 600, 900 GB/s).
    "nvlink-v100": Link("nvlink-v100", 1e-6, 150 * GB),
    "nvlink-a100": Link("nvlink-a100", 1e-6, 300 * GB),
    "nvlink-h100": Link("nvlink-h100", 1e-6, 450 * GB),
}

INTER: dict[str, Link] = {
    # Ethernet line rates (IEEE 802.3) with kernel TCP latencies.
    "eth-1g": Link("eth-1g", 50e-6, 1 * GBIT),
    "eth-10g": Link("eth-10g", 20e-6, 10 * GBIT),
    "eth-25g": Link("eth-25g", 15e-6, 25 * GBIT),
    "eth-100g": Link("eth-100g", 10e-6, 100 * GBIT),
    # InfiniBand HDR and NDR (NVIDIA ConnectX-6 / ConnectX-7 datasheets), RDMA latencies.
    "ib-hdr": Link("ib-hdr", 2e-6, 200 * GBIT),
    "ib-ndr": Link("ib-ndr", 2e-6, 400 * GBIT),
    # AWS Elastic Fabric Adapter, 400 Gbit/s per p4d instance (modelled as one NIC), SRD latency.
    "efa-400g": Link("efa-400g", 15e-6, 400 * GBIT),
}

LINKS: dict[str, Link] = {**INTRA, **INTER}
