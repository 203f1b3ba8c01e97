"""Fitting NCCL's cost models to nccl-tests logs: per-level corrections of latency and transfer time.

For each logged size NCCL's own model picks an algorithm and protocol (as NCCL does, uncorrected);
the pick's time splits into an intra-node latency, an inter-node latency and a transfer term,
so the measured time is linear in the four `Corrections`: t = terms . c. The fit is least squares
on relative error with c >= 0. One-node logs fit the intra pair; multi-node logs the inter pair
(with the intra pair from one-node logs when there are some, else NCCL's figures). alltoall_perf
logs fit the same four corrections to NCCL's all-to-all model (`nccl_alltoall`) on their own
(`fit_alltoall`), and their rows are kept: at a node shape they hold, `sim` and `plan` read the
all-to-all time off them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

import numpy as np

from ringtree.sim.network import nccl_alltoall, nccl_model
from ringtree.sim.network.calibrate import LevelFit, level_fits, nonnegative_lstsq
from ringtree.sim.network.hardware import Link
from ringtree.sim.network.nccl_system import Corrections, NcclSystem, NcclTuning
from ringtree.sim.network.presets import INTER, INTRA

# Intra-node link by GPU generation (SXM parts: NVLink; PCIe parts: their PCIe generation).
_NVLINK = {"volta": "nvlink-v100", "ampere": "nvlink-a100", "hopper": "nvlink-h100"}
_PCIE = {"volta": "pcie-gen3", "ampere": "pcie-gen4", "hopper": "pcie-gen5", "blackwell": "pcie-gen5"}
_NIC = {"volta": "ib-hdr", "ampere": "ib-hdr", "hopper": "ib-ndr", "blackwell": "ib-ndr"}
PARAMS = ("latency_intra", "latency_inter", "transfer_intra", "transfer_inter")


def hardware(
    rows: list[dict[str, Any]], inter: Link | None, nics: int | None
) -> tuple[Link, Link, int, NcclSystem]:
    """The links and NCCL system the logs ran on: GPU from the device names, NICs assumed or given."""
    names = {str(r.get("gpu", "")) for r in rows}
    gens = {nccl_model.generation_of(n) for n in names}
    if len(gens) != 1 or None in gens:
        raise ValueError(
            f"cannot tell one GPU generation from the logs' devices {sorted(names)}: "
            "fit logs of one kind of GPU (V100, A100, H100, B200) at a time"
        )
    gen = str(gens.pop())
    pcie = any("pcie" in n.lower() for n in names)
    intra = INTRA[_PCIE[gen]] if pcie else INTRA.get(_NVLINK.get(gen, ""), Link("nvlink-b200", 1e-6, 900e9))
    nic = inter if inter is not None else INTER[_NIC[gen]]
    per_node = max((int(r["ranks_per_node"]) for r in rows), default=1)
    n_nics = nics if nics is not None else per_node  # DGX/HGX-style: one NIC per GPU
    system = nccl_model.system_from_links(
        gen, "pci" if pcie else "nvlink", intra.bandwidth_Bps, nic.bandwidth_Bps * n_nics, nic.alpha_s
    )
    return intra, nic, n_nics, system


def fit(rows: list[dict[str, Any]], inter: Link | None = None, nics: int | None = None) -> dict[str, Any]:
    """Corrections fitted to nccl-tests rows, as the `nccl` section of a calibration file."""
    intra, nic, n_nics, system = hardware(rows, inter, nics)
    choices = [
        nccl_model.choose(system, int(r["world_size"]), int(r["nodes"]), int(r["bytes"])) for r in rows
    ]
    terms = np.array([c.terms() for c in choices])
    measured = np.array([float(r["time_us"]) for r in rows])
    multi = [int(r["nodes"]) > 1 for r in rows]
    free = [j for j in range(len(PARAMS)) if bool(terms[:, j].any())]
    if not any(not m for m in multi):
        free = [j for j in free if PARAMS[j] != "latency_intra"]  # keep NCCL's figure without 1-node logs
    sizes = {int(r["bytes"]) for r in rows}
    if len(rows) < len(free) or len(sizes) < 2:
        raise ValueError(
            f"{len(rows)} nccl-tests row(s) of {len(sizes)} size(s) cannot fit {len(free)} corrections "
            f"({', '.join(PARAMS[j] for j in free)}): give a log of at least {len(free)} sizes "
            "(e.g. all_reduce_perf -b 8 -e 1G -f 2)"
        )
    c = np.ones(4)
    fixed = terms @ c - terms[:, free] @ c[free]
    c[free] = nonnegative_lstsq(terms[:, free] / measured[:, None], 1.0 - fixed / measured)
    for j in free:
        if PARAMS[j].startswith("transfer") and c[j] <= 0:
            raise ValueError(
                f"the fit found no {PARAMS[j].split('_')[1]}-node transfer cost: the logs are all "
                "latency-bound; include sizes of at least 64 MiB"
            )
    corrections = Corrections(*(float(x) for x in c))
    rel = terms @ c / measured - 1.0
    levels: dict[str, LevelFit] = level_fits(rel, multi)
    return {
        "system": asdict(system),
        "corrections": asdict(corrections),
        "intra": intra.as_dict(),
        "inter": nic.as_dict(),
        "nics_per_node": n_nics,
        "rows": len(rows),
        "fitted": [PARAMS[j] for j in free],
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_rel_error": float(np.abs(rel).max()),
        "levels": {k: v.__dict__ for k, v in levels.items()},
        "table": [
            {
                "file": r["file"], "world_size": r["world_size"], "nodes": r["nodes"], "bytes": r["bytes"],
                "measured_us": m, "nccl_choice": ch.label, "nccl_model_us": ch.model_us,
                "fitted_us": float(t @ c),
            }
            for r, m, ch, t in zip(rows, measured, choices, terms, strict=True)
        ],
    }  # fmt: skip


def fit_alltoall(rows: list[dict[str, Any]], system: NcclSystem) -> dict[str, Any]:
    """Corrections of NCCL's all-to-all model fitted to alltoall_perf rows, with the rows themselves:
    the `alltoall` part of a calibration file's `nccl` section."""
    priced = [
        nccl_alltoall.price(system, int(r["world_size"]), int(r["nodes"]), int(r["bytes"])) for r in rows
    ]
    terms = np.array([q.terms() for q in priced])
    measured = np.array([float(r["time_us"]) for r in rows])
    multi = [int(r["nodes"]) > 1 for r in rows]
    free = [j for j in range(len(PARAMS)) if bool(terms[:, j].any())]
    if all(multi):
        free = [j for j in free if PARAMS[j] != "latency_intra"]  # NCCL's figure without 1-node logs
    sizes = {int(r["bytes"]) for r in rows}
    if len(rows) < len(free) or len(sizes) < 2:
        raise ValueError(
            f"{len(rows)} alltoall_perf row(s) of {len(sizes)} size(s) cannot fit {len(free)} corrections "
            f"({', '.join(PARAMS[j] for j in free)}): give a log of at least {len(free)} sizes "
            "(e.g. alltoall_perf -b 1M -e 1G -f 2)"
        )
    c = np.ones(4)
    fixed = terms @ c - terms[:, free] @ c[free]
    c[free] = nonnegative_lstsq(terms[:, free] / measured[:, None], 1.0 - fixed / measured)
    if not any(c[j] > 0 for j in free if PARAMS[j].startswith("transfer")):
        raise ValueError("the fit found no all-to-all transfer cost: the logs are all latency-bound; "
                         "include sizes of at least 64 MiB")  # fmt: skip
    corrections = Corrections(*(float(x) for x in c))
    fitted = np.array([q.time_us(corrections) for q in priced])
    rel = fitted / measured - 1.0
    return {
        "corrections": asdict(corrections),
        "rows": len(rows),
        "fitted": [PARAMS[j] for j in free],
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_rel_error": float(np.abs(rel).max()),
        "levels": {k: v.__dict__ for k, v in level_fits(rel, multi).items()},
        "table": [
            {
                "file": r["file"], "world_size": r["world_size"], "nodes": r["nodes"], "bytes": r["bytes"],
                "measured_us": m, "nccl_model_us": q.time_us(Corrections()), "fitted_us": float(f),
            }
            for r, m, q, f in zip(rows, measured, priced, fitted, strict=True)
        ],
    }  # fmt: skip


def tuning(section: dict[str, Any]) -> NcclTuning:
    """The NcclTuning of a calibration file's `nccl` section (with its all-to-all fit, if any)."""
    system = NcclSystem(**section["system"])
    alltoall = section.get("alltoall")
    if not alltoall:
        return NcclTuning(system, Corrections(**section["corrections"]))
    return NcclTuning(
        system, Corrections(**section["corrections"]), Corrections(**alltoall["corrections"]), _rows(alltoall)
    )


def _rows(alltoall: dict[str, Any]) -> tuple[tuple[int, int, int, float], ...]:
    """(nodes, ranks per node, bytes, seconds) of the logged all-to-alls, the median of repeated sizes."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for r in alltoall["table"]:
        nodes, p = int(r["nodes"]), int(r["world_size"])
        groups.setdefault((nodes, p // nodes, int(r["bytes"])), []).append(float(r["measured_us"]) * 1e-6)
    return tuple((*key, statistics.median(v)) for key, v in sorted(groups.items()))


def links(section: dict[str, Any]) -> tuple[Link, Link, int]:
    """The intra link, NIC link and NICs per node the section was fitted with."""
    return Link(**section["intra"]), Link(**section["inter"]), int(section["nics_per_node"])
