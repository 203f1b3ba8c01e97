"""A cluster from the command line's words: link presets or custom links, and a calibration file."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from ringtree.sim.network import calibrate, nccl_fit
from ringtree.sim.network.hardware import Cluster, parse_link
from ringtree.sim.network.measured import MeasuredTimes
from ringtree.sim.network.nccl_model import system_from_links
from ringtree.sim.network.presets import INTER, INTRA


def make_cluster(
    nodes: int,
    gpus_per_node: int,
    intra: str | None = None,
    inter: str | None = None,
    calibration: Path | None = None,
    nics_per_node: int | None = None,
) -> Cluster:
    """The cluster a command describes; a calibration stands in for any link not named.

    A two-level calibration gives both links. A one-level calibration measured on one machine
    describes its intra-node link; used for the inter-node link too (when no --inter is given) it
    models a cluster of such machines, with a warning. An nccl-tests calibration also gives NCCL's
    view of the hardware and the fitted corrections, which `native` all-reduces use.
    """
    fitted = calibrate.check(calibrate.load(calibration), calibration) if calibration is not None else None
    if fitted is None and (intra is None or (inter is None and nodes > 1)):
        raise ValueError(
            f"name the links (--intra {'/'.join(INTRA)}; --inter {'/'.join(INTER)}; "
            "or custom 'bw=12.5GB/s,lat=5us') or pass --calibration machine.json"
        )
    if fitted is not None and fitted.nccl is not None:
        return _nccl_cluster(nodes, gpus_per_node, intra, inter, fitted, nics_per_node)
    fitted_inter = fitted.inter_link if fitted else None
    if fitted is not None and inter is None and fitted_inter is None and nodes > 1:
        warnings.warn("no --inter given: the calibrated link also models the network", stacklevel=2)
    intra_link = parse_link(intra, INTRA) if intra else fitted.link if fitted else None
    inter_link = (
        parse_link(inter, INTER) if inter else fitted_inter or (fitted.link if fitted else intra_link)
    )
    assert intra_link is not None and inter_link is not None
    gamma = fitted.gamma_s_per_byte if fitted else Cluster.gamma
    measured = MeasuredTimes.from_calibration(fitted) if fitted else None
    return Cluster(nodes, gpus_per_node, intra_link, inter_link, gamma, nics_per_node or 1, measured=measured)


def _nccl_cluster(
    nodes: int,
    gpus_per_node: int,
    intra: str | None,
    inter: str | None,
    fitted: calibrate.Calibration,
    nics_per_node: int | None,
) -> Cluster:
    """A GPU cluster from an nccl-tests calibration; named links or NIC counts replace its own.

    `native` is priced by the fitted NCCL tuning. ringtree's own algorithms run on the links the
    logs' hardware has (NVLink, NICs), or on the bench-fitted links when bench rows were fitted too.
    """
    assert fitted.nccl is not None
    tuning = nccl_fit.tuning(fitted.nccl)
    nccl_intra, nccl_inter, nics = nccl_fit.links(fitted.nccl)
    nics = nics_per_node or nics
    if intra or inter or nics_per_node:
        old = tuning.system
        nic = parse_link(inter, INTER) if inter else nccl_inter
        system = system_from_links(
            old.generation,
            old.fabric,
            (parse_link(intra, INTRA) if intra else nccl_intra).bandwidth_Bps,
            nic.bandwidth_Bps * nics,
            nic.alpha_s,
        )
        tuning = dataclasses.replace(tuning, system=system, alltoall_rows=())  # rows: the logged hardware
    if fitted.nccl.get("links_from_bench"):
        nccl_intra, nccl_inter = fitted.link, fitted.inter_link or fitted.link
    intra_link = parse_link(intra, INTRA) if intra else nccl_intra
    inter_link = parse_link(inter, INTER) if inter else nccl_inter
    # the logs' rows describe the logged hardware: a cluster with other links does not read them
    measured = None if intra or inter or nics_per_node else MeasuredTimes.from_calibration(fitted)
    return Cluster(
        nodes, gpus_per_node, intra_link, inter_link, fitted.gamma_s_per_byte, nics, tuning, measured
    )
